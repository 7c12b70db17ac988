"""The planner's inputs (model, cluster, job and candidate layouts from the `meshlm plan` options) and its
memory picture: what `meshlm plan` and `meshlm plan --validate` both read."""

from __future__ import annotations

from pathlib import Path

from meshlm.config import grpo_layout_problem
from meshlm.errors import MeshlmError
from meshlm.plan import advisor
from meshlm.plan.cluster import make_cluster
from meshlm.plan.job import job_of
from meshlm.plan.memory import Memory
from meshlm.plan.options import PLANNED, dims, train_config
from meshlm.plan.spec import TINY, load_model, parse_count, with_param_count


def inputs(args, world: int | None = None, gpu_memory: str | None = None):
    """(spec, cluster, job, layouts) from the options; `world`/`gpu_memory` override the cluster (--validate)."""
    cfg, attention = train_config(args)
    precision = "bf16" if cfg.mixed_precision == "bf16" else "fp32"
    cluster = make_cluster(
        1 if world else args.nodes,
        world or args.gpus_per_node,
        "cpu" if getattr(args, "device", "gpu") == "cpu" else args.gpu,
        gpu_memory or args.gpu_memory,
        args.peak_flops,
        args.intra_node,
        args.inter_node,
        args.cpu_memory,
        precision,
    )
    spec = load_model(cfg.model_name or TINY, **dims(args))
    if getattr(args, "params", None):
        spec = with_param_count(spec, parse_count("--params", args.params))
    p = cfg.parallel
    degrees = {
        k: getattr(p, k, None) if f"parallel.{k}" in vars(args) else None for k in ("tp", "pp", "dp", "cp", "ep")
    }
    degrees["dp"] = args.dp
    _check_degrees(spec, degrees["tp"], degrees["pp"])
    job = job_of(cfg, attention, args, spec.max_positions).check(spec, cluster.world)
    _check_float8(job, cluster)
    if not 0 < args.efficiency <= 1:
        raise MeshlmError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    strategies = None
    if args.strategy:
        strategies = [s.strip() for s in args.strategy.split(",")]
        bad = [s for s in strategies if s not in PLANNED]
        if bad:
            raise MeshlmError(f"--strategy {','.join(bad)} is not one of {', '.join(PLANNED)}")
    _check_fixed_degrees(degrees, cluster.world)
    ac = {"auto": (False, True), "none": (False,), "full": (True,)}[args.activation_checkpointing]
    tp, pp, dp, cp = (degrees[k] for k in ("tp", "pp", "dp", "cp"))
    layouts = advisor.candidates(spec, cluster, ac, tp, pp, dp, strategies, cp, job.seq_length)
    if degrees["ep"]:
        layouts = [c for c in layouts if c.ep == degrees["ep"]]
    if job.objective == "grpo":
        layouts = _generating(layouts, cfg.parallel.sequence_parallel)
    if cluster.gpu == "cpu":  # CPU offload moves GPU state to the host: CPU ranks are the host already
        layouts = [c for c in layouts if not c.offload]
    if job.nf4:  # the layouts that hold NF4 weights, as meshlm train checks them (parallel/nf4.py)
        from meshlm.layout import Layout
        from meshlm.parallel.nf4 import layout_problem

        precision = "bf16" if job.precision == "bf16" else "no"
        layouts = [c for c in layouts if not layout_problem(Layout(c.strategy, c.layout.degrees, precision, c.offload))]
    if not layouts:
        raise MeshlmError(
            "no layout matches --parallel.tp/pp/cp/ep, --dp or --strategy for this model and cluster (TP must divide "
            "the heads, kv heads and MLP width, and stay within a node; CP divide the sequence and fit in a node "
            "with TP; PP at most the layers; EP a mixture of experts under FSDP without CP, dividing its experts "
            "and the sharded ranks)"
        )
    return spec, cluster, job, layouts


def _generating(layouts: list, sequence_parallel: bool) -> list:
    """The layouts whose ranks generate from the training model, as meshlm train decides it; none of the degrees
    asked for: train's own line."""
    problems = [grpo_layout_problem(c.strategy, c.cp, sequence_parallel) for c in layouts]
    if layouts and all(problems):
        raise MeshlmError(problems[0])
    return [c for c, problem in zip(layouts, problems, strict=True) if not problem]


def _check_degrees(spec, tp: int | None, pp: int | None) -> None:
    """A tensor-parallel degree as meshlm train checks it (the heads, kv heads, MLP width and experts it splits);
    pipeline stages of whole blocks."""
    if tp and tp > 1:
        from meshlm.parallel.tensor import check_tp

        check_tp(spec.hf_config, tp, choose="a tensor-parallel degree")
    if pp and pp > spec.layers:
        raise MeshlmError(
            f"--parallel.pp {pp} is more than {spec.name}'s {spec.layers} blocks; use at most {spec.layers} "
            "pipeline stages"
        )


def _check_float8(job, cluster) -> None:
    if job.float8 != "off" and not cluster.float8_flops:
        raise MeshlmError(
            f"--float8 {job.float8} needs float8 tensor cores (compute capability 8.9+: h100, h200, l40s, l4); "
            f"--gpu {cluster.gpu} has none"
        )


def _check_fixed_degrees(degrees: dict, world: int) -> None:
    """The degrees given: each divides the GPUs, and tp, pp and dp, all given, multiply to them (with cp)."""
    tp, pp, dp, cp = (degrees[k] for k in ("tp", "pp", "dp", "cp"))
    if tp and pp and dp:
        prod = tp * pp * dp * (cp or 1)
        if prod != world:
            with_cp = f" x --parallel.cp {cp}" if cp else ""
            raise MeshlmError(
                f"--parallel.tp {tp} x --parallel.pp {pp} x --dp {dp}{with_cp} = {prod} GPUs, but the cluster has "
                f"{world} (--nodes x --gpus-per-node); pick degrees whose product is {world}"
            )
    for n, v in degrees.items():
        if v and (v < 1 or world % v):
            name = "--dp" if n == "dp" else f"--parallel.{n}"
            raise MeshlmError(f"{name} {v} does not divide the {world} GPUs; pick a divisor of {world}")


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
