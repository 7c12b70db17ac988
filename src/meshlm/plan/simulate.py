"""`meshlm plan --simulate`: run the plan's layout with meshlm's own code on fake tensors, rank by rank.

For a few representative ranks (the first, the last and one of each pipeline stage) this
process joins a fake process group of the real world size (torch's `fake` backend: collectives
return at once), builds the model with meshlm's build_model on the meta device, gives it fake
storage (FakeTensorMode: shapes and dtypes, no memory), applies meshlm's parallelize with the
layout's own `meshlm train` options (pipeline split, TP, activation checkpointing, FSDP/DDP/ZeRO),
and runs one step of the engine's train_step, gradient clipping and the optimizer step while
live_bytes.LiveBytes counts every storage. Per rank it reports model states (the engine's own
model_state_bytes: parameters between forward and backward, gradients after it, optimizer states
after the step), the forward-backward peak of what the step allocates and frees again
(activations, gathered FSDP units, gradient buckets in flight), and the rank's peak, next to the
analytic plan. Of a pipeline's stages only the first of each kind runs (stand_ins: the first stage, the last,
and each distinct run of middle layers); the others hold the same states and differ by the micro-batches they
keep in flight under 1F1B, which the first's warm-up measures (derived: 3 of Qwen3-235B's 32 stages run).

What stays analytic: communication volume and time (fake collectives move nothing), kernel
workspaces (fused attention, cuBLAS), the allocator's fragmentation, and the temporaries of the
clipping and optimizer step (a fused AdamW has none; fake foreach kernels over-count them).

DDP (ddp, zero1) is torch's own, with stand-ins for the steps of its reducer that read values; they reach parallelize
through its one seam (plan/simulate_standins.py SIMULATED, a parallel/apply.py Standins). Workarounds, all about
values, not sizes: DeviceMesh builds its rank table as a real tensor (layout.build_mesh); FSDP, TP and the pipeline
split run on the meta model (DeviceMesh arithmetic inside them needs real tensors) and every module gets fake storage
afterwards, as meta-device initialisation does, so the step's simulation fills nothing (the seam's `fill`); the
start-up peak (materialize and the engine's buffers) is simulated apart (plan/simulate_startup.py). With `probe`, a
rank runs the probe of `plan --validate` instead (plan/simulate_probe.py, plan/simulate_check.py).
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
import time

import torch
import torch.distributed as dist

from meshlm.data.batch import Batch
from meshlm.errors import MeshlmError
from meshlm.plan import fake_pipeline
from meshlm.plan.advisor import Estimate
from meshlm.plan.job import Job, train_keys
from meshlm.plan.live_bytes import LiveBytes
from meshlm.plan.simulate_probe import probed_steps
from meshlm.plan.simulate_standins import SIMULATED, grouped_experts_by_shapes, reads_values_when_built
from meshlm.plan.simulate_startup import planned_startup, startup_peak
from meshlm.plan.spec import ModelSpec, hf_config_from_dims

FORWARD_BACKWARD = ("forward and backward",)


def representative_ranks(world: int, pp: int) -> list[int]:
    """The first rank, the last, and one rank of every pipeline stage: the first of each stage but the last,
    which the world's last rank represents (a stage's ranks hold equal FSDP and TP shards)."""
    per_stage = world // pp
    return sorted({0, world - 1, *(s * per_stage for s in range(pp - 1))})


def stage_kinds(spec: ModelSpec, cfg) -> list[tuple]:
    """Per pipeline stage, all that sets its rank's memory apart from the micro-batches it holds in flight:
    whether it is the first or the last, and each of its layers' attention type and parameter shapes (the
    split of models/stages.py on the meta model, as meshlm train makes it)."""
    from meshlm.models.build import build_model
    from meshlm.models.families import decoder, pipeline_parts
    from meshlm.models.families.forward import layer_type
    from meshlm.models.stages import stage_layers

    pp = cfg.parallel.pp
    model = build_model(cfg, _Vocab(spec.vocab), "meta")
    layers = getattr(decoder(model), pipeline_parts(model.config, "pipeline parallel").layers)

    def layer_kind(i: int) -> tuple:
        shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in layers[i].named_parameters())
        return layer_type(model.config, i), shapes

    runs = stage_layers(model, pp, cfg.parallel.pp_split)
    return [(s == 0, s == pp - 1, tuple(layer_kind(i) for i in run)) for s, run in enumerate(runs)]


def stand_ins(kinds: list[tuple]) -> list[int]:
    """For each stage, the stage simulated for it: the first of its kind. Stages of one kind differ only in
    the micro-batches they hold in flight under 1F1B (pp - s; the first of a kind holds the most, at least
    3 where the kind has two stages), and their peaks by that many times what one more keeps (derived)."""
    first = {}
    return [first.setdefault(kind, s) for s, kind in enumerate(kinds)]


def train_config(spec: ModelSpec, job: Job, e: Estimate, model_dir: str):
    """The Config `meshlm train` would run this layout with (the advisor's own config keys)."""
    from meshlm import config as config_mod

    cfg = config_mod.load(None, [(k, str(v)) for k, v in train_keys(job, e)])
    cfg.model_name, cfg.pretrained = model_dir, False
    if e.candidate.pp > 1:
        # 1F1B: stage s runs pp - s forwards, then a backward and a forward by turns; its peak is a forward after
        # the first backward (gradients accumulated, pp - s micro-batches in flight): pp + 1 reach it on stage 0
        m = min(e.micro_batches, e.candidate.pp + 1)
        cfg.parallel.micro_batches, cfg.micro_batch_size = m, job.micro_batch * m
    else:  # from the second micro-batch on every gradient exists before it starts: later ones repeat it
        cfg.grad_accum = min(cfg.grad_accum, 2)
    return cfg


def model_dir(spec: ModelSpec) -> str:
    """A directory with the model's config alone (what build_model reads); the model's own one if local."""
    if spec.run_as[:1] == ("--model-name",):
        from pathlib import Path

        if Path(spec.run_as[1]).is_dir():
            return spec.run_as[1]
    if spec.hf_config is not None and spec.experts:  # a mixture of experts: its own config (a preset's)
        path = tempfile.mkdtemp(prefix="meshlm-simulate-")
        spec.hf_config.save_pretrained(path)
        return path
    if not spec.buildable:
        raise MeshlmError(
            f"--simulate builds the model with meshlm, but {spec.name} is given by a parameter count "
            f"only; give its dimensions (--layers, --hidden, ...) instead of --params"
        )
    c = hf_config_from_dims(
        spec.family,
        spec.layers,
        spec.hidden,
        spec.heads,
        spec.kv_heads,
        spec.mlp,
        spec.vocab,
        spec.max_positions,
        tied=spec.tied,
    )
    path = tempfile.mkdtemp(prefix="meshlm-simulate-")
    c.save_pretrained(path)
    return path


class _Vocab:
    """build_model asks the tokenizer only for its length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@contextlib.contextmanager
def _fake_rank(rank: int, world: int):
    from meshlm.compat import FakeStore, clear_dtensor_caches
    from meshlm.parallel.expert import ROUTING

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with ROUTING.balanced_on_fake_tensors():  # a mixture of experts' routers choose nothing on fake tensors
            yield
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding decisions and redistribution plans by mesh layout; the next rank's meshes can
        # compare equal to this one's, and a cached entry would lead it to this rank's process groups (destroyed
        # now) or shard sizes (uneven shards: gpt2's 50257 vocabulary rows over tp 2)
        clear_dtensor_caches()


def simulate_rank(spec: ModelSpec, cfg, rank: int, world: int, probe: bool = False) -> dict:
    """One training step of `rank` on fake tensors; with `probe`, what the probe of `plan --validate` reports
    (plan/simulate_probe.py)."""
    from meshlm.models.build import build_model
    from meshlm.runtime import Runtime

    start = time.perf_counter()
    rt = Runtime(rank=rank, world_size=world, device=torch.device("cpu"), backend="fake")
    with _fake_rank(rank, world), grouped_experts_by_shapes():
        model = build_model(cfg, _Vocab(spec.vocab), "meta")  # outside fake mode: Module.to cannot swap fakes
        return _step(spec, cfg, rt, model, start, probe)


def _step(spec: ModelSpec, cfg, rt, model, start: float, probe: bool = False) -> dict:
    from meshlm.compat import FakeTensorMode
    from meshlm.engines.base import local, storage_bytes
    from meshlm.layout import resolve
    from meshlm.models.materialize import retie, shared_parameters
    from meshlm.parallel.apply import parallelize

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    layout = resolve(cfg, rt.world_size, model.config)
    if reads_values_when_built(layout):
        with fake:  # these engines read their parameters when built (broadcast, master copies)
            ties = shared_parameters(model)
            model.to_empty(device="cpu")
            retie(model, ties)  # to_empty gives each holder of a tied weight its own copy; materialize re-ties
            engine = parallelize(model, cfg, rt, layout, SIMULATED)
    else:
        # FSDP, TP and the pipeline split run on the meta model (DeviceMesh arithmetic needs real tensors), then
        # every module gets fake storage, as meta-device initialisation does
        engine = parallelize(model, cfg, rt, layout, SIMULATED)
        with fake:
            for m in _modules(model, engine):
                m.to_empty(device="cpu")
    if layout.pp > 1:
        fake_pipeline.state_shapes(engine, cfg, layout, spec)
    with fake:
        optimizer = engine.make_optimizer(lr=1e-4, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        rows = cfg.micro_batch_size
        micro = [Batch.of_ids(torch.randint(0, spec.vocab, (rows, cfg.seq_length))) for _ in range(cfg.grad_accum)]
        if probe:
            return probed_steps(engine, optimizer, micro, cfg.grad_clip)
        resident = storage_bytes(engine.parameters()) + storage_bytes(model.buffers())
        held = [local(t) for m in _modules(model, engine) for t in (*m.parameters(), *m.buffers())]
        with LiveBytes(held) as live:
            live.phase = FORWARD_BACKWARD[0]
            forwards = _Forwards(live, getattr(engine, "stages", ()))
            with forwards:
                engine.train_step(micro)
            live.phase = "clip and optimizer"
            engine.clip_grad_norm(cfg.grad_clip)
            optimizer.step()
            gc.collect()
        states = engine.model_state_bytes(optimizer)
        opt_states = storage_bytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0
        )
        transient, _ = live.transient_peak(FORWARD_BACKWARD)
        return {
            "rank": rt.rank,
            "model_states": states,
            "parameters": _or(engine.param_bytes, storage_bytes(engine.parameters())),
            "gradients": _or(engine.grad_bytes, storage_bytes(p.grad for p in engine.parameters())),
            "optimizer": opt_states,
            "activations_and_buffers": transient,
            "peak": resident + opt_states + live.phase_peaks.get(FORWARD_BACKWARD[0], 0),
            "per_micro_batch": forwards.kept_per_micro_batch(),
            "seconds": time.perf_counter() - start,
        }


class _Forwards:
    """Stands in for the pipeline stages' PipelineTrace (engines/pipeline_trace.py) during the simulated step: where
    LiveBytes's events stood as each forward of a micro-batch ended."""

    def __init__(self, live: LiveBytes, stages):
        self.live, self.stages, self.ends = live, stages, []  # ends: of the forwards before the first backward
        self.warming_up = True

    def __enter__(self):
        for s in self.stages:
            s.trace = self

    def __exit__(self, *exc):
        for s in self.stages:
            s.trace = None

    def now(self) -> None:
        return None

    def add(self, stage: int, action: str, chunk: int, start) -> None:
        self.warming_up = self.warming_up and action == "F"
        if self.warming_up:
            self.ends.append(len(self.live.events))

    def kept_per_micro_batch(self) -> tuple[int, int] | None:
        """(bytes, of them those freed within the step) that one more micro-batch in flight holds: the growth
        from the second forward's end to the third's, both in 1F1B's warm-up (not from the first: it may also
        make what the step allocates once); None where the warm-up has fewer (a stage holding 1 or 2)."""
        if len(self.ends) < 3:
            return None
        (live1, freed1), (live2, freed2) = self.live.totals_at(self.ends[1:3])
        return live2 - live1, freed2 - freed1


def _or(measured, now: int) -> int:
    """What train_step measured, or (engines that do not measure: the pipeline's) what the rank holds now."""
    return now if measured is None else measured


def _modules(model, engine) -> list:
    """The rank's modules: the model, the engine's (wrapped) model and a pipeline's stage modules."""
    return list({id(m): m for m in (model, engine.model, *getattr(engine, "modules", ()))}.values())


def not_simulated(e: Estimate, job: Job) -> str | None:
    """Why layout e cannot be simulated, or None."""
    if job.objective != "sft":  # the simulated step is train_step on token batches: an sft step
        return f"the simulation runs sft steps: --objective {job.objective}'s pairs and reference are not simulated"
    if e.candidate.offload:
        return "meshlm builds CPU offload only where CUDA is present"
    return None


def simulate(spec: ModelSpec, job: Job, e: Estimate) -> list[dict]:
    """Every representative rank of layout e, each next to the plan of its pipeline stage: simulated where it
    is the first stage of its kind (stand_ins), else derived from that one's simulation."""
    if why := not_simulated(e, job):
        return [{"skipped": why}]
    cfg = train_config(spec, job, e, model_dir(spec))
    world, pp = e.candidate.world, e.candidate.pp
    per_stage = world // pp
    stand_in = stand_ins(stage_kinds(spec, cfg)) if pp > 1 else [0]
    done: dict[int, dict] = {}
    out = []
    for rank in representative_ranks(world, pp):
        stage = rank // per_stage
        if stand_in[stage] == stage:
            sim = done[stage] = simulate_rank(spec, cfg, rank, world)
            sim["stage"] = stage
            sim.update(startup_peak(cfg, _Vocab(spec.vocab), rank, world, _fake_rank))
        else:
            sim = derived(done[stand_in[stage]], rank, stage, in_flight(cfg, stage) - in_flight(cfg, stand_in[stage]))
        _add_plan(sim, spec, job, e)
        out.append(sim)
    return out


def in_flight(cfg, stage: int) -> int:
    """Micro-batches pipeline stage `stage` holds at once under 1F1B as simulated (advisor.stages's rule)."""
    return min(cfg.parallel.micro_batches, cfg.parallel.pp - stage)


def derived(sim: dict, rank: int, stage: int, more: int) -> dict:
    """Stage `stage`'s rank from the simulation of a stage of its kind that holds `more` fewer micro-batches in
    flight: the same states and start-up, its peaks moved by `more` times what one micro-batch keeps."""
    kept, freed = sim["per_micro_batch"]
    return {
        **sim,
        "rank": rank,
        "stage": stage,
        "peak": sim["peak"] + more * kept,
        "activations_and_buffers": sim["activations_and_buffers"] + more * freed,
        "derived_from": sim["rank"],
        "seconds": 0.0,
    }


def _add_plan(sim: dict, spec: ModelSpec, job: Job, e: Estimate) -> None:
    mem, _ = e.stages[sim["stage"]]
    sim["plan"] = {
        "model_states": sum(mem.states.values()),
        "activations_and_buffers": in_step_bytes(mem),
        "peak": mem.gpu_total,
        "startup": planned_startup(spec, job, e, sim["stage"]),
    }


def in_step_bytes(mem) -> int:
    """What the plan says a step allocates and frees in forward and backward: the activation peak and the
    temporary buffers, less those that live across steps (DDP's buckets) or only in the optimizer step."""
    lasting = ("ddp gradient buckets", "fp32 copy of the owned gradients (optimizer step)", "fp32 parameter shards")
    return mem.act.peak + sum(v for k, v in mem.temp.items() if k not in lasting)


def report(spec: ModelSpec, job: Job, ests: list[Estimate]) -> tuple[str, list[dict]]:
    """The table: per layout and representative rank, simulated vs planned bytes and their ratio."""
    size = max((e.memory.gpu_total for e in ests), default=0)
    name, unit = ("GiB", 2**30) if size >= 2**30 else ("MiB", 2**20)
    lines = [
        (
            f"simulated one training step of {spec.name} per representative rank (fake tensors, fake process "
            f"group) vs the plan; {name} per rank"
        ),
        f"{'layout':<24} {'rank':>5} {'stage':>5}  {'quantity':<26} {'simulated':>10} {'plan':>10} {'ratio':>6}",
    ]
    results = []
    for e in ests:
        for r in simulate(spec, job, e):
            results.append({"layout": e.candidate.name, **r})
            if "skipped" in r:
                lines.append(f"{e.candidate.name:<24} not simulated: {r['skipped']}")
                continue
            for key, label in (
                ("model_states", "model states"),
                ("activations_and_buffers", "activations + step buffers"),
                ("peak", "peak"),
                ("startup", "start-up peak"),
            ):
                sim, plan = r[key], r["plan"][key]
                lines.append(
                    f"{e.candidate.name:<24} {r['rank']:>5} {r['stage']:>5}  {label:<26} {sim / unit:>10.3f} "
                    f"{plan / unit:>10.3f} {sim / plan if plan else float('nan'):>6.3f}"
                )
            lines.append(
                f"{'':<24} {'':>5} {'':>5}  (parameters {r['parameters'] / unit:.3f}, gradients "
                f"{r['gradients'] / unit:.3f}, optimizer {r['optimizer'] / unit:.3f}; "
                + (f"derived from rank {r['derived_from']})" if "derived_from" in r else f"{r['seconds']:.1f} s)")
            )
    return "\n".join(lines), results
