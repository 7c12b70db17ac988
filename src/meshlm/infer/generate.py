"""`meshlm generate`: batch generation in one of four layouts, results in input order, metrics at the end.

Reads top to bottom: check every input (before anything is written) -> load the
model -> lay it out for the mode -> decode this rank's batches -> gather to
rank 0 -> write the .jsonl and the .json summary once.

  dp           every rank holds the whole model and takes a slice of the prompts
  tp           one model sharded across ranks (tensor parallel); all ranks decode the same batches
  pp           the model cut into stages, one per rank; micro-batches of prompts flow through them
  layer-split  one process, layers spread over several devices; one device computes at a time
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshlm import runtime
from meshlm.errors import MeshlmError
from meshlm.infer.decode import (
    Completion,
    Decoder,
    Sampling,
    Timings,
    generate_batch,
    kv_cache,
    make_batch,
    model_forward,
    stages_forward,
)
from meshlm.infer.load import (
    DTYPES,
    ModelChoice,
    eos_ids,
    load_model,
    load_slices,
    per_shard,
)
from meshlm.infer.prompts import encode, read_prompts, render
from meshlm.infer.results import gather, records, report, summarize, write_atomic
from meshlm.layout import Layout
from meshlm.models.build import max_positions
from meshlm.models.source import ModelSource
from meshlm.runtime import Runtime, log, memory

MODES = ("dp", "tp", "pp", "layer-split")


@dataclass
class GenerateOptions:
    prompts: str = ""
    prompts_split: str = "train"
    out: str = ""
    summary: str = ""  # default: <out without .jsonl>.summary.json
    overwrite: bool = False
    mode: str = "dp"
    model: ModelChoice = field(default_factory=ModelChoice)
    devices: str = ""
    micro_batches: int = 0
    max_new_tokens: int = 64
    batch_size: int = 8
    sampling: Sampling = field(default_factory=Sampling)
    truncate: bool = False
    backend: str = "auto"

    @property
    def summary_path(self) -> Path:
        out = Path(self.out)
        return Path(self.summary) if self.summary else out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")


@dataclass
class PreparedPrompts:
    """The checked inputs: prompts, their token ids, and the model's config and tokenizer."""

    prompts: list[str]
    token_ids: list[list[int]]
    truncated: list[bool]
    model: ModelSource


# ---------------------------------------------------------------- checks


def _check_generate_options(opts: GenerateOptions, world: int) -> None:
    if opts.mode not in MODES:
        raise MeshlmError(f"--mode must be one of {', '.join(MODES)}, got {opts.mode!r}")
    for name, value, least in (
        ("max-new-tokens", opts.max_new_tokens, 1),
        ("batch-size", opts.batch_size, 1),
        ("micro-batches", opts.micro_batches, 0),
    ):
        if value < least:
            raise MeshlmError(f"--{name} must be at least {least}, got {value}")
    s = opts.sampling
    if s.temperature < 0 or not 0 < s.top_p <= 1:
        raise MeshlmError(f"--temperature must be >= 0 and --top-p in (0, 1]; got {s.temperature} and {s.top_p}")
    if not opts.out:
        raise MeshlmError("--out is required: the .jsonl file to write, one record per prompt")
    for path in (Path(opts.out), opts.summary_path):
        if path.exists() and not opts.overwrite:
            raise MeshlmError(f"{path} exists; pass --overwrite to replace it or choose another --out")
        if path.is_dir():
            raise MeshlmError(f"{path} is a directory; --out and --summary name files")
    if opts.mode == "layer-split":
        if world > 1:
            raise MeshlmError(f"--mode layer-split runs in one process; drop --nproc {world}")
        devices(opts.devices)
    elif opts.devices:
        raise MeshlmError(f"--devices is for --mode layer-split; --mode {opts.mode} places one rank per device")


def devices(spec: str) -> list[torch.device]:
    """`cuda:0,cuda:1` or `cpu,cpu` -> devices, each one checked to exist (by layer split's own parser)."""
    from meshlm.parallel.layer_split import parse_devices

    if len([d for d in spec.split(",") if d.strip()]) < 2:
        raise MeshlmError(
            f"--mode layer-split needs two or more --devices, e.g. cuda:0,cuda:1 (cpu,cpu on CPU); got {spec!r}"
        )
    return parse_devices(spec)


def _check_model_for_mode(opts: GenerateOptions, mcfg, world: int) -> None:
    """What the model must allow for the mode, worded for `generate` (the layout files check the rest)."""
    from meshlm.models.families import pipeline_parts

    layers = getattr(mcfg, "num_hidden_layers", None)
    if opts.mode == "tp":
        from meshlm.parallel.tensor import check_tp

        check_tp(mcfg, world, f"--mode tp on {world} ranks", "an --nproc")  # training's rule, in generate's words
    elif opts.mode in ("pp", "layer-split"):
        pipeline_parts(mcfg, "pipeline parallel" if opts.mode == "pp" else "layer split")
        n = world if opts.mode == "pp" else len(devices(opts.devices))
        if layers is not None and layers < n:
            where = f"{n} ranks" if opts.mode == "pp" else f"{n} devices"
            raise MeshlmError(f"--mode {opts.mode} on {where} needs at least one layer each; the model has {layers}")


def prepare(opts: GenerateOptions, world: int) -> PreparedPrompts:
    """Check every input and read prompts, tokenizer and model config; writes nothing, loads no weights."""
    _check_generate_options(opts, world)
    res = opts.model.source()
    _check_model_for_mode(opts, res.model_config, world)
    if opts.mode == "tp" and res.lora and res.cfg.lora.quantize != "none":  # models/source.py _nf4_base
        raise MeshlmError(
            f"a --lora.quantize {res.cfg.lora.quantize} run's checkpoint generates with --mode dp, pp or layer-split "
            f"(whole projections: its base as it trained on it, the adapters merged); --mode tp would split them "
            f"across the quantisation's blocks"
        )
    prompts, templated = render(read_prompts(opts.prompts, opts.prompts_split), res.tokenizer)
    positions = max_positions(res.model_config)
    ids, cut = encode(prompts, res.tokenizer, positions, opts.max_new_tokens, opts.truncate, templated)
    return PreparedPrompts(prompts, ids, cut, res)


# ---------------------------------------------------------------- decoding


def longest_first(work: PreparedPrompts, indices) -> list[int]:
    """Longest prompts first: similar lengths share a batch (little padding) and the slowest batch starts first."""
    return sorted(indices, key=lambda i: (-len(work.token_ids[i]), i))


def dp_share(work: PreparedPrompts, world: int, rank: int) -> list[int]:
    """This rank's prompts: dealt round-robin from the longest-first order, so every prompt goes to exactly one
    rank and the token counts stay balanced; a rank may get none when there are fewer prompts than ranks."""
    return longest_first(work, range(len(work.prompts)))[rank::world]


def pad_id(tokenizer, eos: list[int]) -> int:
    """Padding never reaches the attention (masked) nor the output; any id will do, the tokenizer's first."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return eos[0] if eos else 0


def decode_all(
    forward, new_cache, indices: list[int], work: PreparedPrompts, opts: GenerateOptions, eos: list[int], device
) -> tuple[list[Completion], Timings]:
    """Decode `indices` in batches of --batch-size, in the given order."""
    pad = pad_id(work.model.tokenizer, eos)
    done, timings = [], Timings()
    for chunk in _chunks(indices, opts.batch_size):
        batch = make_batch(chunk, [work.token_ids[i] for i in chunk], pad, device)
        comps, t = generate_batch(forward, new_cache, batch, opts.max_new_tokens, eos, pad, opts.sampling)
        done += comps
        timings.extend(t)
    return done, timings


def _chunks(xs: list, n: int) -> list[list]:
    return [xs[i : i + n] for i in range(0, len(xs), n)]


def load_for_mode(opts: GenerateOptions, work: PreparedPrompts, rt: Runtime):
    """Load the model and lay it out for the mode. Returns (decode, devices): decode() generates this rank's
    share and returns (completions, timings); devices are the ones whose memory this rank reports."""
    # tp, pp, layer split: built on the meta device, split, then each rank reads only its slices
    split = per_shard(work.model, opts.mode)
    model = load_model(work.model, opts.model.dtype, rt.device, meta=split)
    init = work.model.initial_weights(model) if split else None
    if split and not work.model.lora:  # still on meta: each rank allocates its part once, in --dtype
        model.to(dtype=DTYPES[opts.model.dtype])  # (layer split before placing it)

    def fill():
        if split:
            load_slices(model, init, work.model, rt.device)
            model.to(dtype=DTYPES[opts.model.dtype])  # LoRA: merged in float32 first, as dp merges

    eos = eos_ids(model, work.model.tokenizer, work.model.step_dir is not None)
    new_cache = lambda: kv_cache(model.config)  # noqa: E731
    everything = longest_first(work, range(len(work.prompts)))
    pad = pad_id(work.model.tokenizer, eos)
    lay = Layout.for_inference(opts.mode, rt.world_size)
    if opts.mode == "dp":
        mine = dp_share(work, lay.dp, rt.rank)
        return lambda: decode_all(model_forward(model), new_cache, mine, work, opts, eos, rt.device), [rt.device]
    if opts.mode == "tp":
        if lay.tp_enabled:  # the training layout of --parallel.tp N on N ranks, and its mesh
            from meshlm.parallel.expert import apply_experts
            from meshlm.parallel.tensor import apply_tp

            tp_mesh = lay.mesh(rt.device.type)["tp"]
            apply_tp(model, tp_mesh)
            apply_experts(model, tp_mesh, tp_mesh)  # a mixture of experts: whole experts per rank, as training
        fill()

        def decode_tp():  # every rank decodes every batch (their collectives pair up); rank 0 reports them
            comps, timings = decode_all(model_forward(model), new_cache, everything, work, opts, eos, rt.device)
            return (comps, timings) if rt.is_main else ([], Timings())

        return decode_tp, [rt.device]
    if opts.mode == "pp":
        return _decode_pp(model, fill, work, opts, rt, everything, new_cache, eos, pad), [rt.device]
    # layer-split: consecutive blocks on consecutive devices, activations hop across; one device works at a time
    from meshlm.parallel.layer_split import place

    devs = devices(opts.devices)
    stages = place(model, devs)
    fill()
    return lambda: decode_all(stages_forward(stages, devs), new_cache, everything, work, opts, eos, devs[0]), devs


def _decode_pp(model, fill, work: PreparedPrompts, opts: GenerateOptions, rt: Runtime, everything, new_cache, eos, pad):
    """--mode pp: this rank keeps only its pipeline stage of the model and runs every batch through it (one
    batch per micro-batch); returns decode()."""
    from meshlm.infer.pipelined import Ring, decode_pipelined
    from meshlm.models.stages import build_stages, keep_only

    batches = [
        make_batch(chunk, [work.token_ids[i] for i in chunk], pad, rt.device)
        for chunk in _chunks(everything, opts.batch_size)
    ]
    stage = build_stages(model, rt.world_size)[rt.rank]
    keep_only(model, [stage])  # this rank holds only its stage's weights
    fill()

    def new_decoder(batch):
        return Decoder(batch, new_cache(), opts.max_new_tokens, eos, pad, opts.sampling)

    in_flight = opts.micro_batches or rt.world_size
    ring = Ring.of_world(stage, rt.rank, rt.world_size)
    return lambda: decode_pipelined(ring, batches, new_decoder, model.config.hidden_size, model.dtype, in_flight)


# ---------------------------------------------------------------- entry


def run(opts: GenerateOptions) -> dict | None:
    """One rank of `meshlm generate` (or the whole job); rank 0 returns the summary."""
    want_cuda = opts.backend != "gloo" and torch.cuda.is_available() and opts.mode != "layer-split"
    rt = runtime.init(opts.backend, want_cuda=want_cuda)
    runtime.setup_logging(rt)
    try:
        return generate(opts, rt)
    finally:
        runtime.shutdown()


def generate(opts: GenerateOptions, rt: Runtime) -> dict | None:
    """Generate on the ranks of `rt` (a process group already joined); rank 0 writes and returns the summary."""
    decode = None
    try:
        with runtime.rank0_first(local=True):  # a hub dataset or tokenizer is downloaded once per node
            work = prepare(opts, rt.world_size)
        if rt.is_main:
            log.info(f"attention {opts.model.kernel(work.model)} (--attention {opts.model.attention})")
        decode, used = load_for_mode(opts, work, rt)
        runtime.barrier()  # every rank has its model: the clock starts together, loading excluded
        t0, cpu0 = time.perf_counter(), time.process_time()
        comps, timings = decode()
        cpu = time.process_time() - cpu0  # this rank's compute, whatever else shares its cores
        mine = [{"rank": rt.rank, "device": str(d), "cpu_s": cpu, **memory(d)} for d in dict.fromkeys(used)]
        parts = gather((comps, timings, mine))
        if not rt.is_main:
            return None
        wall = time.perf_counter() - t0
        all_timings = Timings()
        for _, t, _ in parts:
            all_timings.extend(t)
        recs = records([c for p in parts for c in p[0]], work)
        summary = summarize(opts, recs, all_timings, [m for p in parts for m in p[2]], wall, rt.world_size)
        write_atomic(Path(opts.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
        write_atomic(opts.summary_path, json.dumps(summary, indent=1) + "\n")
        report(summary)
        log.info(f"wrote {opts.out} and {opts.summary_path}")
        return summary
    finally:
        # Free the model (DTensor shards hold the process group) before the group and the interpreter go:
        # once, a tp rank aborted in gloo's teardown at interpreter exit with the model still alive.
        decode = None
        gc.collect()
