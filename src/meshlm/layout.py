"""The resolved layout: strategy, mesh degrees, the engine that runs it and the mesh, decided once from the
config and the world size.

Over 400 lines by design: every rule of what composes with what is here, in one place, so no other module
re-checks a layout. Every check of a layout lives in `resolve` and runs before any rank or model exists (the
launcher calls it, the trainer calls it again on each rank with the same answer). What comes
out is frozen and is what the rest reads: the launcher's checks, the trainer, parallelize
(`Layout.engine` names the engine it builds), generation, verify's layouts and the planner's
candidates. The strategy names are config.Strategy; which of them shard, replicate or run in
one process is said here only.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp (as torchtitan). Tensor
parallel is innermost so its frequent all-reduces stay between neighbouring ranks (one node);
context parallel next to it (an all-to-all per attention); pipeline parallel is outermost because
its point-to-point traffic is the lightest and tolerates slow inter-node links. The cp ranks of a
data-parallel rank read the same sequences and split each of them (parallel/context.py); their
gradients average with the data-parallel ranks' (DDP over dp x cp, FSDP sharding over dp_shard x cp,
as torchtitan folds cp into FSDP). The degrees and the mesh live here, with the layout: parallel/
reads them from here (a technique's checks are called from `resolve`, inside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshlm.compat import flatten_mesh, unset_fake_temporarily
from meshlm.config import Config, Strategy, to_args
from meshlm.errors import MeshlmError

FSDP_STRATEGIES = ("zero2", "zero3", "fsdp", "hsdp")  # parameters sharded by FSDP2 over dp_shard
REPLICATED = ("ddp", "zero1")  # whole parameters on every data-parallel rank, gradients all-reduced by DDP
ONE_PROCESS = ("single", "dp", "layer-split")
# what each strategy is called where it runs (Layout.in_words); the model-parallel degrees after it
IN_WORDS = {
    "single": "one process",
    "dp": "nn.DataParallel over the visible devices in one process",
    "layer-split": "layers split over the devices in one process",
    "ddp": "data parallel (DDP)",
    "zero1": "ZeRO-1 data parallel",
    "zero2": "ZeRO-2 sharded data parallel",
    "zero3": "ZeRO-3 sharded data parallel",
    "fsdp": "FSDP sharded data parallel",
    "hsdp": "hybrid sharded data parallel (replicas x shards)",
}
MODEL_PARALLEL = ("tensor parallel", "pipeline parallel", "context parallel", "expert parallel")
PIPELINE_DP = ("ddp", *FSDP_STRATEGIES)  # what replicates or shards the stages of a pipeline

# The engines parallel/apply.py builds, one per kind (engines/: base.py's Engine for "single", ddp.py,
# zero1.py, fsdp.py, master_weights.py for "masters", pipeline.py, dp.py, layer_split.py).
EngineKind = Literal["single", "dp", "ddp", "zero1", "fsdp", "masters", "pipeline", "layer-split"]


@dataclass(frozen=True)
class Degrees:
    """The size of each mesh dimension (outermost first); their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallel: a factor of dp_shard (experts split over it; not a dimension of its own)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks whose gradients are averaged: the data-parallel ranks and, within each, its cp ranks."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Mesh:
    """The 5-D mesh (size-1 dimensions included) and its flattened dimensions: dp (data ranks), dp_cp (ranks
    averaging gradients: DDP's group) and dp_shard_cp (FSDP's shards); without cp the last two are dp and
    dp_shard themselves (no process groups made for nothing). With expert parallel also "experts" (the ranks
    one layer's experts are split over: ep data-parallel ranks x the tp ranks) and "efsdp" (the data-parallel
    ranks each expert's weights are FSDP-sharded over: dp_shard / ep, with dp_replicate under hsdp), as
    torchtitan's ep and dp_shard_mod_ep."""

    world: DeviceMesh
    flat: dict
    degrees: Degrees

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.flat[name] if name in self.flat else self.world[name]


# The meshes built on the current process group, by (group, device type, degrees): a process that runs several jobs
# in turn (the Python API, a notebook, the tests' family runs) reuses their process groups, where each new mesh made
# new ones that lived, with three gloo threads each, as long as the process: 407 of them made a process running
# 94 tiny jobs on 2 ranks spend 72% more CPU (203 CPU-s against 118; 6.9M context switches against 0.7M).
_MESHES: dict[tuple, Mesh] = {}


def build_mesh(device_type: str, d: Degrees) -> Mesh:
    """The mesh of degrees `d` on the current process group, built once (_MESHES); a new group (after
    destroy_process_group, or each rank `meshlm plan --simulate` fakes) gets its own."""
    group = dist.group.WORLD
    key = (group, device_type, d)
    if key not in _MESHES:
        for stale in [k for k in _MESHES if k[0] is not group]:  # a destroyed group's
            del _MESHES[stale]
        _MESHES[key] = _new_mesh(device_type, d)
    return _MESHES[key]


def _new_mesh(device_type: str, d: Degrees) -> Mesh:
    # The mesh's rank table is a real tensor even when `meshlm plan --simulate` runs the layout on fake ones.
    with unset_fake_temporarily():
        if d.ep > 1:
            return _expert_mesh(device_type, d)
        world = init_device_mesh(device_type, tuple(getattr(d, n) for n in DIMENSIONS), mesh_dim_names=DIMENSIONS)
        flat = {"dp": flatten_mesh(world["dp_replicate", "dp_shard"], "dp")}
        if d.cp > 1:
            flat["dp_cp"] = flatten_mesh(world["dp_replicate", "dp_shard", "cp"], "dp_cp")
            flat["dp_shard_cp"] = flatten_mesh(world["dp_shard", "cp"], "dp_shard_cp")
        else:
            flat["dp_cp"], flat["dp_shard_cp"] = flat["dp"], world["dp_shard"]
        return Mesh(world, flat, d)


def _expert_mesh(device_type: str, d: Degrees) -> Mesh:
    """dp_shard built as (efsdp, ep) and flattened back: the ep ranks of an expert group are neighbours (the
    inner data-parallel dimension), each expert's FSDP shards lie across groups. Context parallel: the ep ranks
    of a group share their cp (and tp) coordinate, each cp rank dispatching its own part of the sequences to
    the experts of its group; the cp ranks hold the same experts, so they join the experts' FSDP shards
    (efsdp x cp), as cp joins every other parameter's (dp_shard_cp). cp lies between efsdp and ep so that the
    experts' 2-D mesh (efsdp x cp, ep x tp) keeps its dimensions in the mesh's order (DTensor flattens it
    to reduce their norm)."""
    efsdp = d.dp_shard // d.ep
    names = ("pp", "dp_replicate", "efsdp", "cp", "ep", "tp")
    world = init_device_mesh(device_type, (d.pp, d.dp_replicate, efsdp, d.cp, d.ep, d.tp), mesh_dim_names=names)
    # the flattened meshes are kept, not sliced again from the root (torch deprecates slicing a flattened name)
    flat = {"dp_shard": flatten_mesh(world["efsdp", "ep"], "dp_shard")}
    flat["dp"] = flatten_mesh(world["dp_replicate", "efsdp", "ep"], "dp")
    flat["experts"] = flatten_mesh(world["ep", "tp"], "experts") if d.tp > 1 else world["ep"]
    if d.cp > 1:
        flat["dp_cp"] = flatten_mesh(world["dp_replicate", "efsdp", "cp", "ep"], "dp_cp")
        flat["dp_shard_cp"] = flatten_mesh(world["efsdp", "cp", "ep"], "dp_shard_cp")
        shards = flatten_mesh(world["efsdp", "cp"], "efsdp_cp")
    else:
        flat["dp_cp"], flat["dp_shard_cp"], shards = flat["dp"], flat["dp_shard"], world["efsdp"]
    flat["efsdp"] = world["dp_replicate", shards.mesh_dim_names[0]] if d.dp_replicate > 1 else shards
    return Mesh(world, flat, d)


def one_rank_mesh(device: torch.device) -> Mesh:
    """FSDP on a single rank shards nothing, but its CPU offload and bf16 policy still apply: the way to
    fit a model that needs offloading on one GPU. FSDP needs a process group, so make a 1-rank one."""
    if not dist.is_initialized():
        # gloo beside NCCL: offloaded gradients (and their norm) are CPU tensors (runtime.backend_spec)
        dist.init_process_group(
            "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    return build_mesh(device.type, Degrees())


@dataclass(frozen=True)
class Layout:
    """How a job's ranks split the model: a strategy, the degrees of the 5-D mesh (pp, dp_replicate,
    dp_shard, cp, tp) and the two options that change which engine runs it (`engine`): --mixed-precision and
    --cpu-offload. The mesh itself is built on first use (it needs the process group)."""

    strategy: Strategy
    degrees: Degrees = Degrees()
    precision: str = "no"  # --mixed-precision: "no" (fp32) or "bf16"
    offload: bool = False  # --cpu-offload: FSDP keeps parameters, gradients and optimizer states on the CPU
    _meshes: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def world(self) -> int:
        return self.degrees.world

    @property
    def dp(self) -> int:
        return self.degrees.dp

    @property
    def tp(self) -> int:
        return self.degrees.tp

    @property
    def cp(self) -> int:
        return self.degrees.cp

    @property
    def pp(self) -> int:
        return self.degrees.pp

    @property
    def ep(self) -> int:
        return self.degrees.ep

    @property
    def engine(self) -> EngineKind:
        """Which engine runs this layout; parallel/apply.py builds it from this alone. bf16 zero1/zero2 on
        several ranks without TP, PP or offload keep fp32 masters per owner rank (engines/master_weights.py)."""
        s = self.strategy
        if s in ("layer-split", "dp"):
            return s
        if self.masters:
            return "masters"
        if self.pp_enabled:
            return "pipeline"
        if s in FSDP_STRATEGIES:
            return "fsdp"
        if self.replicated:
            return s
        return "single"  # one rank, or tensor parallel alone: nothing to replicate

    @property
    def masters(self) -> bool:
        """bf16 zero1/zero2 with fp32 master weights owned per rank (what FSDP2's bf16 policy cannot give)."""
        one_model = not (self.tp_enabled or self.pp_enabled or self.cp_enabled or self.offload)
        return self.strategy in ("zero1", "zero2") and self.precision == "bf16" and self.averages and one_model

    @property
    def sharded(self) -> bool:
        """FSDP2 runs: parameters, gradients and optimizer states sharded over the data-parallel ranks (zero2,
        zero3, fsdp, hsdp), also on one rank (offload, bf16 policy); not bf16 zero2 with fp32 masters, nor
        pipeline stages without data-parallel ranks."""
        fsdp = self.strategy in FSDP_STRATEGIES and not self.masters
        return fsdp and (self.averages or not self.pp_enabled)

    @property
    def hybrid(self) -> bool:
        """FSDP over (dp_replicate, dp_shard): sharded within groups, replicated across them (hsdp)."""
        return self.strategy == "hsdp"

    @property
    def reshards_after_forward(self) -> bool:
        """FSDP frees gathered parameters after each unit's forward; zero2 keeps them until its backward
        (and so accumulates whole gradients over micro-batches)."""
        return self.strategy != "zero2"

    @property
    def replicated(self) -> bool:
        """Whole parameters on more than one data-parallel rank, kept equal by DDP (ddp, zero1)."""
        return self.strategy in REPLICATED and self.averages

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def averages(self) -> bool:
        """Gradients are averaged over several ranks (data-parallel ranks, or a rank's cp ranks)."""
        return self.degrees.dp_cp > 1

    @property
    def shards_state(self) -> bool:
        """Whether a rank holds less model state than one device does (what verify holds a layout to)."""
        return self.tp_enabled or self.pp_enabled or self.ep > 1 or self.strategy in ("zero1", *FSDP_STRATEGIES)

    def mesh(self, device_type: str) -> Mesh | None:
        """The DeviceMesh (built once): None for one rank, except that FSDP on one rank still needs one."""
        if device_type not in self._meshes:
            if self.world > 1:
                self._meshes[device_type] = build_mesh(device_type, self.degrees)
            elif self.sharded:
                self._meshes[device_type] = one_rank_mesh(torch.device(device_type))
            else:
                self._meshes[device_type] = None
        return self._meshes[device_type]

    @classmethod
    def for_inference(cls, mode: str, world: int) -> Layout:
        """`meshlm generate --mode` on `world` ranks as a layout: dp gives every rank the whole model, tp and pp
        split it as training's --parallel.tp / --parallel.pp on as many ranks do (the same mesh), layer-split
        places it on --devices in one process."""
        if mode == "layer-split":
            return cls("layer-split")
        d = {"dp": Degrees(dp_replicate=world), "tp": Degrees(tp=world), "pp": Degrees(pp=world)}[mode]
        return cls("single" if world == 1 else "ddp", d)

    def keys(self) -> list[tuple[str, str]]:
        """The config keys that give this layout."""
        d = self.degrees
        keys = [("strategy", self.strategy), ("parallel.tp", str(d.tp)), ("parallel.pp", str(d.pp))]
        keys += [("parallel.cp", str(d.cp))] * (d.cp > 1)
        keys += [("parallel.ep", str(d.ep))] * (d.ep > 1)
        return keys + [("parallel.shard_size", str(d.dp_shard))] * (self.strategy == "hsdp")

    def to_args(self) -> list[str]:
        """The `meshlm train` options that give this layout (config.parse_args reads them back)."""
        return to_args(self.keys())

    def in_words(self) -> str:
        """The layout named by what runs: "tensor parallel 2", not "ddp" with one data-parallel rank."""
        if self.strategy in ("dp", "layer-split"):
            return IN_WORDS[self.strategy]
        d = self.degrees
        data = f"{d.dp_replicate}x{d.dp_shard}" if self.strategy == "hsdp" else str(d.dp)
        parts = [f"{IN_WORDS[self.strategy]} {data}"] * (d.dp > 1 or self.sharded)
        parts += [f"{name} {n}" for name, n in zip(MODEL_PARALLEL, (d.tp, d.pp, d.cp, d.ep)) if n > 1]
        return " x ".join(parts) or "one process, no parallelism"

    def describe(self) -> str:
        d = self.degrees
        ep = f" (experts over ep={d.ep})" if d.ep > 1 else ""
        dims = " ".join(f"{n}={getattr(d, n)}" + ep * (n == "dp_shard") for n in DIMENSIONS)
        return f"strategy {self.strategy}; mesh {dims}"


def strategy_for(strategy: str, world: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> Strategy:
    """--strategy, with auto decided: single for one rank; tensor-parallel shards are DTensors, which FSDP
    shards further (2-D) and DDP cannot hold, so fsdp when TP meets data parallel; context parallel's ranks
    shard the states too (as torchtitan folds cp into FSDP), so fsdp with cp; expert parallel is carved out
    of FSDP's shards, so fsdp with it; else ddp."""
    if strategy != "auto":
        return strategy
    if world == 1:
        return "single"
    return "fsdp" if ((tp > 1 or cp > 1) and world // (tp * pp) > 1) or ep > 1 else "ddp"


def degrees(
    strategy: Strategy, world: int, tp: int = 1, pp: int = 1, shard_size: int = 0, ep: int = 1, cp: int = 1
) -> Degrees:
    """The degrees of every mesh dimension for `world` ranks, or a one-line error saying what does not fit."""
    if strategy in ONE_PROCESS and world > 1:
        raise MeshlmError(f"--strategy {strategy} runs in one process; drop --nproc {world} or pick ddp/fsdp")
    if world % (tp * pp * cp):
        cp_part = (" x cp", f" x {cp}") if cp > 1 else ("", "")
        raise MeshlmError(
            f"world size {world} is not divisible by tp x pp{cp_part[0]} = {tp} x {pp}{cp_part[1]}; "
            f"use a rank count that is a multiple of {tp * pp * cp}"
        )
    dp = world // (tp * pp * cp)
    if strategy == "hsdp":
        shard = shard_size or dp
        if dp % shard:
            raise MeshlmError(
                f"--parallel.shard-size {shard} does not divide the {dp} data-parallel ranks; pick a divisor of {dp}"
            )
        return Degrees(pp, dp // shard, shard, cp, tp, _expert_degree(ep, shard, strategy, cp))
    if strategy in FSDP_STRATEGIES:
        return Degrees(pp, 1, dp, cp, tp, _expert_degree(ep, dp, strategy, cp))
    return Degrees(pp, dp, 1, cp, tp, _expert_degree(ep, dp, strategy, cp))


def _expert_degree(ep: int, shard: int, strategy: Strategy, cp: int) -> int:
    """--parallel.ep, checked: a factor of the data-parallel ranks FSDP shards over (torchtitan carves ep out of
    them too). Context-parallel ranks are not among them: each dispatches its own tokens within its expert group,
    and shards the experts' weights with the remaining data-parallel ranks (build_mesh)."""
    if ep > 1 and strategy not in FSDP_STRATEGIES:
        raise MeshlmError(
            f"--parallel.ep {ep} splits the experts over FSDP's shards: use --strategy {', '.join(FSDP_STRATEGIES)} "
            f"(or auto), not {strategy}"
        )
    if shard % ep:
        what = "ranks of an hsdp shard group" if strategy == "hsdp" else "data-parallel ranks"
        fix = f"pick an ep that divides {shard}"
        if cp > 1:  # the cp ranks of a sequence are not data-parallel ranks
            what += (
                f" (experts are split over data-parallel ranks, not over the --parallel.cp {cp} ranks of a sequence)"
            )
            fix = f"add ranks or {fix}"
        raise MeshlmError(f"--parallel.ep {ep} does not divide the {shard} {what}; {fix}")
    return ep


def resolve(cfg: Config, world: int, model_config=None) -> Layout:
    """The layout of `world` ranks, checked before any process or model exists. `model_config` (heads,
    widths, layers) is read from the config when TP, PP or layer-split need it and none is given."""
    par = cfg.parallel
    strategy = strategy_for(cfg.strategy, world, par.tp, par.pp, par.ep, par.cp)
    _check_options(cfg, strategy)
    d = degrees(strategy, world, par.tp, par.pp, par.shard_size, par.ep, par.cp)
    layout = Layout(strategy, d, cfg.mixed_precision, cfg.cpu_offload)
    if problem := composition_error(layout):
        raise MeshlmError(problem)
    if cfg.lora.r and cfg.lora.quantize != "none":  # NF4's layouts and shapes (parallel/nf4.py)
        from meshlm.models.build import model_config as read_model_config
        from meshlm.parallel.nf4 import check

        check(cfg, layout, model_config or read_model_config(cfg))
    experts_lora = cfg.lora.r > 0 and cfg.lora.targets  # may name a mixture of experts' weights
    if (
        layout.tp_enabled
        or layout.pp_enabled
        or layout.cp_enabled
        or layout.ep > 1
        or strategy == "layer-split"
        or experts_lora
        or cfg.float8 != "off"
    ):
        _check_model(cfg, layout, model_config)
    return layout


def composition_error(layout: Layout) -> str:
    """Why the strategy cannot hold these degrees ('' when it can): the rules resolve enforces and the
    planner's candidates (plan/advisor.py) are drawn from."""
    if layout.tp_enabled and layout.averages and not layout.sharded:
        d = layout.degrees
        ranks = f"{layout.dp} data-parallel" if not layout.cp_enabled else f"{d.dp_cp} data- and context-parallel"
        return (
            f"tensor parallel with {ranks} ranks needs --strategy fsdp "
            f"(DDP cannot hold tensor-parallel shards), not {layout.strategy}"
        )
    if layout.pp_enabled and layout.averages and layout.strategy not in PIPELINE_DP:
        return (
            f"pipeline parallel composes with --strategy {', '.join(PIPELINE_DP)} "
            f"for its data-parallel ranks, not {layout.strategy}"
        )
    return ""


def _check_options(cfg: Config, strategy: Strategy) -> None:
    """Options that contradict the strategy, whatever the model."""
    if cfg.cpu_offload and strategy not in FSDP_STRATEGIES:
        raise MeshlmError(f"--cpu-offload works with --strategy {'/'.join(FSDP_STRATEGIES)}, not {strategy}")
    if cfg.lora.r:  # parallel/lora.py imports DTensor (~1 CPU s in the launcher): only when LoRA is on
        from meshlm.parallel.lora import check_strategy

        check_strategy(cfg, strategy)
    if strategy == "dp":
        from meshlm.engines.dp import check_dp

        check_dp(cfg.compile)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if strategy == "layer-split" and (tp > 1 or pp > 1):
        raise MeshlmError(
            "--strategy layer-split places layers on --devices in one process; "
            "it does not combine with --parallel.tp or --parallel.pp"
        )
    if cfg.parallel.sequence_parallel and tp == 1:
        raise MeshlmError("--parallel.sequence-parallel needs --parallel.tp 2 or more")
    if cfg.parallel.sequence_parallel and cfg.seq_length % tp:
        raise MeshlmError(
            f"--parallel.sequence-parallel splits each sequence over tp = {tp} ranks; "
            f"--seq-length {cfg.seq_length} is not a multiple of {tp}"
        )


def _check_model(cfg: Config, layout: Layout, model_config) -> None:
    """What the model's shape must allow: heads dividing by tp, enough layers for the stages or devices."""
    if model_config is None:
        from meshlm.models.build import model_config as read_model_config

        model_config = read_model_config(cfg)  # the config alone (no weights)
    if layout.strategy == "layer-split":
        from meshlm.parallel.layer_split import check_layer_split

        check_layer_split(cfg, model_config)
    if layout.tp_enabled:
        from meshlm.parallel.tensor import check_tp

        check_tp(model_config, layout.tp)
        if cfg.parallel.sequence_parallel:
            from meshlm.models.families import check_sequence_parallel

            check_sequence_parallel(model_config)
    if layout.pp_enabled:
        from meshlm.parallel.pipeline import check_pipeline

        check_pipeline(cfg, model_config)
    if layout.cp_enabled:
        from meshlm.parallel.context import check_context

        check_context(cfg, model_config, layout.tp)
    if layout.ep > 1:
        from meshlm.parallel.expert import check_expert_parallel

        check_expert_parallel(model_config, layout.ep, layout.tp)
    if cfg.float8 != "off":
        from meshlm.parallel.float8 import check_model

        check_model(cfg.float8, model_config)
    if cfg.lora.r > 0:
        from meshlm.parallel.lora import check_expert_targets

        check_expert_targets(cfg, model_config)
