"""The planner's inputs (model, cluster, job and candidate layouts from the `meshlm plan` options) and its
memory picture: what `meshlm plan` and `meshlm plan --validate` both read."""

from __future__ import annotations

from pathlib import Path

from meshlm.config import STRATEGIES
from meshlm.errors import MeshlmError
from meshlm.plan import advisor
from meshlm.plan.memory import Memory
from meshlm.plan.spec import DIMS, Job, check_degrees, load_model, make_cluster, parse_count, with_param_count

# The strategies the planner models: dp (nn.DataParallel) and layer-split are single-process, and
# fsdp is zero3 under another name.
PLANNED = tuple(s for s in STRATEGIES if s not in ("auto", "dp", "fsdp", "layer-split"))


def inputs(args, world: int | None = None, gpu_memory: str | None = None):
    """(spec, cluster, job, layouts) from the options; `world`/`gpu_memory` override the cluster (--validate)."""
    cluster = make_cluster(
        1 if world else args.nodes,
        world or args.gpus_per_node,
        "cpu" if getattr(args, "device", "gpu") == "cpu" else args.gpu,
        gpu_memory or args.gpu_memory,
        args.peak_flops,
        args.intra_node,
        args.inter_node,
        args.cpu_memory,
        args.precision,
    )
    spec = load_model(args.model, **{k: getattr(args, k) for k in DIMS})
    if getattr(args, "params", None):
        spec = with_param_count(spec, parse_count("--params", args.params))
    check_degrees(spec, args.tp, args.pp)
    seq = args.seq_length or min(2048, spec.max_positions or 2048)
    job = Job(
        seq,
        args.micro_batch_size,
        args.global_batch_size,
        args.precision,
        args.optimizer,
        args.attention,
        args.margin,
        args.lora_r,
        args.objective,
        args.precompute_reference,
        args.chunked_loss,
        args.activation_offload,
        getattr(args, "lora_targets", ""),
        args.cp_attention,
        float8=args.float8,
        cpu_ranks=getattr(args, "device", "gpu") == "cpu",
    ).check(spec, cluster.world)
    _check_float8(job, cluster)
    if not 0 < args.efficiency <= 1:
        raise MeshlmError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    strategies = None
    if args.strategy:
        strategies = [s.strip() for s in args.strategy.split(",")]
        bad = [s for s in strategies if s not in PLANNED]
        if bad:
            raise MeshlmError(f"--strategy {','.join(bad)} is not one of {', '.join(PLANNED)}")
    _check_fixed_degrees(args, cluster.world)
    ac = {"auto": (False, True), "none": (False,), "full": (True,)}[args.activation_checkpointing]
    layouts = advisor.candidates(spec, cluster, ac, args.tp, args.pp, args.dp, strategies, args.cp, seq)
    if args.ep:
        layouts = [c for c in layouts if c.ep == args.ep]
    if cluster.gpu == "cpu":  # CPU offload moves GPU state to the host: CPU ranks are the host already
        layouts = [c for c in layouts if not c.offload]
    if not layouts:
        raise MeshlmError(
            "no layout matches --tp/--pp/--dp/--cp/--ep/--strategy for this model and cluster (TP must divide "
            "the heads, kv heads and MLP width, and stay within a node; CP divide the sequence and fit in a node "
            "with TP; PP at most the layers; EP a mixture of experts under FSDP without CP, dividing its experts "
            "and the sharded ranks)"
        )
    return spec, cluster, job, layouts


def _check_float8(job, cluster) -> None:
    if job.float8 != "off" and not cluster.float8_flops:
        raise MeshlmError(
            f"--float8 {job.float8} needs float8 tensor cores (compute capability 8.9+: h100, h200, l40s, l4); "
            f"--gpu {cluster.gpu} has none"
        )


def _check_fixed_degrees(args, world: int) -> None:
    """--tp/--pp/--dp/--cp/--ep: each divides the GPUs, and all of tp, pp, dp given multiply to them."""
    fixed = [(n, getattr(args, n)) for n in ("tp", "pp", "dp", "cp", "ep") if getattr(args, n)]
    if fixed and all(getattr(args, n) for n in ("tp", "pp", "dp")):
        prod = args.tp * args.pp * args.dp * (args.cp or 1)
        if prod != world:
            cp = f" x --cp {args.cp}" if args.cp else ""
            raise MeshlmError(
                f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp}{cp} = {prod} GPUs, but the cluster has "
                f"{world} (--nodes x --gpus-per-node); pick degrees whose product is {world}"
            )
    for n, v in fixed:
        if v < 1 or world % v:
            raise MeshlmError(f"--{n} {v} does not divide the {world} GPUs; pick a divisor of {world}")


def components(m: Memory) -> dict[str, int]:
    """The planner's itemised memory as the picture's components: parameters, gradients and optimizer states
    as they are, activations at their peak (stored + transient, autocast's bf16 weight copies included), and
    buffers = the temporaries (gathered FSDP units and their unsharded gradients)."""
    return {**m.states, "activations": m.act.peak, "buffers": sum(m.temp.values())}


def plot(
    args,
    memories: dict[str, Memory],
    gpu_bytes: int,
    title: str,
    measured: dict[str, int] | None = None,
    limit_label: str = "GPU memory",
    measured_label: str = "measured",
) -> Path:
    from meshlm.report import plot_memory_bars

    path = Path(args.output_dir or ".") / "plan-memory.png"
    return plot_memory_bars(
        {name: components(m) for name, m in memories.items()},
        path,
        gpu_bytes,
        measured,
        title,
        limit_label,
        measured_label,
    )
