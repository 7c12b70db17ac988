"""`meshlm plan` options, the terminal table and --json."""

from __future__ import annotations

import argparse
import json
import shlex

from meshlm.errors import MeshlmError
from meshlm.plan import advisor
from meshlm.plan.advisor import Estimate, GiB, Plan
from meshlm.plan.inputs import PLANNED, inputs, plot
from meshlm.plan.spec import DIMS, GPUS, LINKS, MOE_PRESETS, PRESETS, TINY


def add_options(p: argparse.ArgumentParser) -> None:
    """`meshlm plan`'s options, in the groups and order --help shows them."""
    _add_model_options(p)
    _add_cluster_options(p)
    _add_job_options(p)
    _add_output_options(p)
    _add_check_options(p)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The model to plan: a preset, a directory or hub id, or raw dimensions."""
    m = p.add_argument_group("model (config only: no weights are read)")
    m.add_argument(
        "--model",
        default=TINY,
        metavar="NAME",
        help=f"a preset ({', '.join([TINY, *PRESETS, *MOE_PRESETS])}), a local directory or a hub id "
        f"[default: {TINY}, meshlm's built-in model]",
    )
    m.add_argument("--family", choices=("llama", "gpt2"), help="raw dimensions: block layout")
    for dim in DIMS[1:]:
        m.add_argument("--" + dim.replace("_", "-"), type=int, metavar="N", help=f"raw dimensions: {dim}")
    m.add_argument(
        "--params",
        metavar="COUNT",
        help="the model at exactly this many parameters (e.g. 7.5B): the "
        "blocks are scaled to hold them, activations keep the model's dimensions",
    )


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Nodes, GPUs and the links between them."""
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes in the cluster")
    c.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node")
    c.add_argument(
        "--gpu",
        default="h100",
        type=str.lower,  # a node's GPUs are named in capitals (L4, H100)
        metavar="NAME",
        help=f"{', '.join(GPUS)} (any case): memory, peak FLOP/s, HBM bandwidth",
    )
    c.add_argument("--gpu-memory", metavar="SIZE", help="per GPU, e.g. 80GiB, 80GB, 80e9 (overrides --gpu)")
    c.add_argument(
        "--peak-flops", metavar="FLOPS", help="per GPU for the job's precision, e.g. 989e12 (overrides --gpu)"
    )
    c.add_argument(
        "--intra-node",
        default="",
        metavar="LINK",
        help=f"{', '.join(LINKS)} or a rate (300GB/s) [default: pcie for l40s and l4, else nvlink]",
    )
    c.add_argument("--inter-node", default="infiniband", metavar="LINK", help="as --intra-node")
    c.add_argument("--cpu-memory", default="2TiB", metavar="SIZE", help="per node, for CPU offload")
    c.add_argument(
        "--device",
        default="gpu",
        choices=("gpu", "cpu"),
        help="cpu: the ranks are CPU processes (meshlm train without GPUs); the peak is priced as their resident "
        "memory, glibc's heap keeping the activations through the optimizer step (docs/plan.md)",
    )


def _add_job_options(p: argparse.ArgumentParser) -> None:
    """What one training step does: sequence, batch, precision, optimizer, checkpointing, LoRA."""
    j = p.add_argument_group("job")
    j.add_argument(
        "--seq-length", type=int, metavar="N", help="tokens per sequence [default: min(2048, the model's positions)]"
    )
    j.add_argument("--micro-batch-size", type=int, default=1, metavar="N", help="sequences per GPU per forward pass")
    j.add_argument(
        "--global-batch-size", type=int, default=0, metavar="N", help="sequences per step [default: micro-batch x GPUs]"
    )
    j.add_argument("--precision", default="bf16", metavar="P", help="fp32, or bf16 (mixed: fp32 master weights)")
    j.add_argument("--optimizer", default="adamw", metavar="OPT", help="adamw or sgd (with momentum)")
    j.add_argument(
        "--activation-checkpointing", default="auto", choices=("auto", "none", "full"), help="auto: plan both"
    )
    j.add_argument(
        "--attention", default="fused", metavar="KIND", help="fused (SDPA flash / memory-efficient) or eager"
    )
    j.add_argument(
        "--lora.r",
        dest="lora_r",
        type=int,
        default=0,
        metavar="R",
        help="LoRA adapters of rank R on the attention and MLP projections, base frozen [default: 0, full fine-tuning]",
    )
    j.add_argument(
        "--lora.targets",
        dest="lora_targets",
        default="",
        metavar="NAMES",
        help="the adapted weights, as meshlm train (a mixture of experts' gate_up_proj,down_proj adapt its experts)",
    )
    _add_long_sequence_options(j)
    j.add_argument(
        "--float8",
        default="off",
        choices=("off", "tensorwise", "rowwise"),
        help="the blocks' Linear layers in float8, as meshlm train: at the GPU's float8 peak; tensorwise FSDP "
        "gathers their weights in float8",
    )
    j.add_argument(
        "--objective",
        default="sft",
        choices=("sft", "dpo"),
        help="dpo: a reference forward per step, and without LoRA a frozen copy of the model",
    )
    j.add_argument(
        "--dpo.precompute-reference",
        dest="precompute_reference",
        action="store_true",
        help="dpo: the reference's log-probabilities precomputed into the cache (no reference model or forward)",
    )
    j.add_argument("--margin", type=float, default=0.10, metavar="F", help="fraction of GPU memory kept free")
    j.add_argument(
        "--efficiency", type=float, default=0.5, metavar="F", help="fraction of peak FLOP/s the matmuls reach"
    )


def _add_long_sequence_options(j) -> None:
    """The chunked loss, activation offload and context parallel's attention scheme (docs/long-sequences.md)."""
    j.add_argument(
        "--chunked-loss",
        default="auto",
        metavar="C",
        help="the LM head's loss over chunks of tokens: auto, on, off or tokens per chunk, as meshlm train",
    )
    j.add_argument(
        "--activation-offload", action="store_true", help="saved activations in host memory, as meshlm train"
    )
    j.add_argument(
        "--cp-attention",
        default="auto",
        metavar="S",
        help="how context-parallel ranks attend: auto, ulysses, ring or allgather, as meshlm train's "
        "--parallel.cp-attention",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Which layouts to plan and how to show them."""
    f = p.add_argument_group("which layouts")
    f.add_argument("--strategy", metavar="LIST", help=f"comma-separated subset of {', '.join(PLANNED)}")
    f.add_argument("--tp", type=int, metavar="N", help="only this tensor-parallel degree")
    f.add_argument("--pp", type=int, metavar="N", help="only this pipeline-parallel degree")
    f.add_argument("--dp", type=int, metavar="N", help="only this data-parallel degree")
    f.add_argument("--cp", type=int, metavar="N", help="only this context-parallel degree (each sequence over N)")
    f.add_argument("--ep", type=int, metavar="N", help="only this expert-parallel degree (a mixture of experts)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="machine-readable output")
    o.add_argument("--top", type=int, default=10, metavar="N", help="rows in the table")
    o.add_argument("--all", action="store_true", help="every layout, those that do not fit too")
    o.add_argument(
        "--plot",
        action="store_true",
        help="draw the table's layouts as stacked bars of predicted memory "
        "per GPU by component, with the GPU memory line (and the measured values with --validate) into "
        "plan-memory.png in --output-dir or the current directory",
    )


def _add_check_options(p: argparse.ArgumentParser) -> None:
    """--simulate and --validate: the plan checked against meshlm's own code, on fake tensors or real ranks."""
    s = p.add_argument_group("simulation: run the plan with meshlm's code on fake tensors (no memory) and compare")
    s.add_argument(
        "--simulate",
        action="store_true",
        help="one step of the recommended layout (with --all: of "
        "every layout in the table) for its first, last and each pipeline stage's first rank (stages of "
        "one kind derived from the first's simulation); with "
        "--validate, every rank of each validated layout against what it measured",
    )
    v = p.add_argument_group("validation: run the layouts that fit here and compare")
    v.add_argument("--validate", action="store_true", help="train a few steps per layout on this machine's ranks")
    v.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks for --validate")
    v.add_argument(
        "--steps", type=int, default=3, metavar="N", help="steps per validation run; the last one is measured"
    )
    v.add_argument(
        "--output-dir",
        default="",
        metavar="DIR",
        help="where validation runs and --plot write [default: "
        "a temporary directory for the runs, the current directory for the plot]",
    )


def run(args) -> int:
    if args.plot:
        from meshlm.report import require_matplotlib

        require_matplotlib()
    if args.validate:
        from meshlm.plan.validate import validate

        return validate(args)
    spec, cluster, job, layouts = inputs(args)
    result = advisor.plan(spec, job, cluster, layouts, args.efficiency)
    picture = None
    # the table's rows; when nothing fits, the leanest layouts (how far over the line they are)
    drawn = shown(result, args.top, args.all) or sorted(result.estimates, key=_order)[: args.top]
    if args.plot and drawn:  # none: no layout splits the global batch, and the table says why
        picture = plot(
            args,
            {e.candidate.name: e.memory for e in drawn},
            cluster.gpu_memory,
            f"{spec.name} on {cluster.world} {cluster.gpu.upper()}: predicted memory per GPU (fullest "
            f"pipeline stage); fits below {_in_gib(cluster.gpu_memory * (1 - job.margin))} GiB "
            f"(--margin {job.margin:.0%})",
        )
    simulated = None
    if args.simulate:
        from meshlm.plan.simulate import report

        chosen = shown(result, args.top, args.all)[: None if args.all else 1]
        if not chosen:
            raise MeshlmError("--simulate: no layout fits to simulate; add --all to simulate every layout")
        table, simulated = report(spec, job, chosen)
    if args.json:
        print(
            json.dumps(
                {
                    **to_json(spec, cluster, job, result),
                    **({"plot": str(picture)} if picture else {}),
                    **({"simulated": simulated} if simulated is not None else {}),
                },
                indent=1,
            )
        )
    else:
        print(render(spec, cluster, job, result, args.top, args.all))
        if picture:
            print(f"\nplot: {picture}")
        if simulated is not None:
            print("\n" + table)
    return 0


def to_json(spec, cluster, job, result: Plan) -> dict:
    win = result.ranked[0] if result.ranked else None
    return {
        "model": {k: v for k, v in spec.__dict__.items() if k not in ("run_as", "buildable", "hf_config")},
        "cluster": {**cluster.__dict__, "world": cluster.world},
        "job": job.__dict__,
        "layouts": [e.to_dict() for e in sorted(result.estimates, key=_order)],
        "recommendation": {
            "layout": win.candidate.name if win else None,
            "top3": [e.candidate.name for e in result.ranked[:3]],
            "reasons": result.reasons,
            "command": shlex.join(result.command) if result.command else None,
        },
    }


def _order(e: Estimate):
    return (0, *advisor.rank_key(e)) if e.fits else (1, e.memory.gpu_total)


def _in_gib(n: float) -> str:
    return f"{n / GiB:.2f}" if n < 10 * GiB else f"{n / GiB:.1f}"


def _size(n: float) -> str:
    """Memory in a column: 29.5G, 6.8M, 460K."""
    for unit, size in (("G", GiB), ("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}B" if n else "0"


def _traffic(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def shown(result: Plan, top: int, show_all: bool) -> list[Estimate]:
    """The table's rows: the fitting layouts, fastest first (--top of them), or with --all every one."""
    return sorted(result.estimates, key=_order) if show_all else result.ranked[:top]


def _cluster(cluster) -> str:
    if cluster.gpu == "cpu":
        return (
            f"cluster {cluster.world} CPU rank(s) on this machine ({_in_gib(cluster.gpu_memory)} GiB of its RAM and "
            f"{cluster.peak_flops / 1e9:.0f} GFLOP/s fp32 each, measured here), gloo over loopback "
            f"~{cluster.intra[0] / 1e9:.0f} GB/s (rough)"
        )
    return (
        f"cluster {cluster.nodes} node(s) x {cluster.gpus_per_node} {cluster.gpu.upper()} "
        f"({_in_gib(cluster.gpu_memory)} GiB, {cluster.peak_flops / 1e12:.0f} TFLOP/s), links "
        f"{cluster.intra[0] / 1e9:.0f} GB/s inside a node, {cluster.inter[0] / 1e9:.0f} GB/s between nodes"
    )


def render(spec, cluster, job, result: Plan, top: int, show_all: bool) -> str:
    unit = "rank" if cluster.gpu == "cpu" else "GPU"  # what holds one rank's memory
    lines = [
        f"model   {spec.name}: {spec.params / 1e6:,.1f}M parameters, {spec.layers} blocks, hidden {spec.hidden}, "
        f"{spec.heads} heads ({spec.kv_heads} kv), MLP {spec.mlp}, vocab {spec.vocab}",
        _cluster(cluster),
        f"job     seq {job.seq_length}, micro-batch {job.micro_batch}, global batch {job.global_batch}, "
        f"{job.precision}{_float8(job, cluster)}, {job.optimizer}, {job.attention} attention; "
        f"{job.margin:.0%} of {unit} memory kept free" + _objective(job),
        "",
    ]
    rows = sorted(result.estimates, key=_order)
    head = (
        f"{'#':>3}  {'layout':<24} {'fits':>4} {unit + ' mem':>8} {'states':>7} {'activ':>7} {'temp':>7} "
        f"{'CPU':>6} {'comm/' + unit:>9} {'step s':>8} {'tokens/s':>10} {'MFU':>5} {'bubble':>6}"
    )
    lines += [f"memory per {unit} (G = GiB, M = MiB), communication = bytes each {unit} sends per step"]
    lines += [head, "-" * len(head)]
    for i, e in enumerate(shown(result, top, show_all), 1):
        m = e.memory
        lines.append(
            f"{i:>3}  {e.candidate.name:<24} {'yes' if e.fits else 'no':>4} {_size(m.gpu_total):>8} "
            f"{_size(sum(m.states.values())):>7} {_size(m.act.peak):>7} {_size(sum(m.temp.values())):>7} "
            f"{_size(m.cpu):>6} {_traffic(sum(c.wire for c in e.comm)):>9} {e.step_s:>8.3g} "
            f"{e.tokens_per_s:>10,.0f} {e.mfu:>5.0%} {e.bubble:>6.0%}"
        )
    n_fit = len(result.ranked)
    if not show_all:
        lines.append(f"     {n_fit} of {len(rows)} layouts fit; --all lists every one, --json gives every number")
    if result.ranked:
        lines += ["", *detail(result.ranked[0], "winner", unit)]
    lines += ["", "recommendation:"] + [f"  - {r}" for r in result.reasons]
    if result.ranked:
        lines.append(
            "  top three by step time: "
            + ", ".join(f"{e.candidate.name} ({e.step_s:.3g} s)" for e in result.ranked[:3])
        )
        lines += ["", "run it:", "  " + shlex.join(result.command)]
        if not spec.run_as:
            lines.append("  (the changed dimensions need a model directory with that config: add --model-name DIR)")
    return "\n".join(lines)


def detail(e: Estimate, title: str, unit: str = "GPU") -> list[str]:
    m = e.memory
    out = [
        f"{title}: {e.candidate.name}: {_size(m.gpu_total)} per {unit} of {_size(e.budget)} usable "
        f"({'fits, ' + _size(e.headroom) + ' to spare' if e.fits else 'does NOT fit'}); start-up peak "
        f"{_size(e.startup)} (this rank's fp32 part, one full tensor being drawn, what its engine allocates next)"
    ]
    out.append("  states      " + ", ".join(f"{k} {_size(v)}" for k, v in m.states.items()))
    out.append(
        "  activations "
        + ", ".join(f"{k} {_size(v)}" for k, v in m.act.parts.items())
        + f", transient {_size(m.act.transient)} (peak {_size(m.act.peak)}); one block per micro-batch: "
        f"{_size(m.act.per_layer)} stored, {_size(m.act.per_layer_ckpt)} checkpointed"
    )
    if m.temp:
        out.append("  temporary   " + ", ".join(f"{k} {_size(v)}" for k, v in m.temp.items()))
    if m.step:
        out.append(
            f"  step        the optimizer step's fp32 temporaries {_size(m.step)} (foreach AdamW's sqrt of the "
            f"second moments; with master weights also the gradients' copy) beside the states alone "
            f"(its peak {_size(sum(m.states.values()) + m.step)})"
        )
    if m.cpu:
        out.append(f"  CPU         {_size(m.cpu)} per rank of offloaded states")
    for c in e.comm:
        out.append(
            f"  {c.kind:<15} {c.what} over {c.group} ({c.ranks}): payload {_traffic(c.payload)}, sends "
            f"{_traffic(c.wire)} in {c.calls} calls, {c.seconds * 1e3:.3g} ms"
            f"{' (overlapped)' if c.overlapped else ''}"
        )
    out.append(
        f"  time        compute {e.compute_s:.3g} s, optimizer {e.optimizer_s:.3g} s, exposed communication "
        f"{e.exposed_comm_s:.3g} s -> step {e.step_s:.3g} s, {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.0%}"
        + (f", grad accumulation {e.grad_accum}" if e.grad_accum > 1 else "")
        + (f", {e.micro_batches} pipeline micro-batches, bubble {e.bubble:.0%}" if e.candidate.pp > 1 else "")
    )
    return out + [f"  note        {n}" for n in e.notes]


def _float8(job, cluster) -> str:
    if job.float8 == "off":
        return ""
    return f" with float8 {job.float8} block matmuls ({cluster.float8_flops / 1e12:.0f} TFLOP/s)"


def _objective(job) -> str:
    """What DPO adds to a step (train/dpo.py), in the job line."""
    if job.objective != "dpo":
        return ""
    if not job.reference_forward:
        return "\n        dpo: reference log-probabilities precomputed (no reference model, no reference forward)"
    held = "a frozen fp32 copy of the model, sharded as the parameters" if job.reference_copy else "LoRA's own base"
    return f"\n        dpo: one reference forward per micro-batch (no gradients); the reference is {held}"
