"""`meshlm plan`: the run, the terminal table and --json (its options: plan/options.py)."""

from __future__ import annotations

import json
import shlex

from meshlm.errors import MeshlmError
from meshlm.plan import advisor
from meshlm.plan.advisor import Estimate, GiB, Plan
from meshlm.plan.inputs import inputs, plot
from meshlm.plan.job import json_fields
from meshlm.plan.options import add_options

__all__ = ["add_options", "inputs", "run"]


def run(args) -> int:
    if args.plot:
        from meshlm.report import require_matplotlib

        require_matplotlib()
    if args.validate:
        from meshlm.plan.validate import validate

        return validate(args)
    spec, cluster, job, layouts = inputs(args)
    if args.simulate and job.nf4:
        raise MeshlmError(
            "--simulate runs the model on fake tensors, which torchao's NF4Tensor does not support: simulate the "
            "job with --lora.quantize none, or plan it without --simulate (the plan prices the NF4 base by its bytes)"
        )
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
        "job": json_fields(job),
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
        f"{_size(e.startup)} (this rank's parameters as allocated, one full tensor being drawn, what its engine "
        "allocates next)"
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
    if m.generation:  # GRPO: before the training forwards, beside the states and the gathered units
        out.append("  generation  " + ", ".join(f"{k} {_size(v)}" for k, v in m.generation.items()))
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
    """What DPO or GRPO adds to a step (objectives/), in the job line."""
    if job.objective == "grpo":
        ref = ", a reference forward per micro-batch (--grpo.beta > 0)" if job.reference_forward else ""
        return (
            f"\n        grpo: groups of {job.grpo_group} completions of up to {job.grpo_new_tokens} new tokens "
            f"generated each step with a KV cache (plan/grpo_cost.py){ref}"
        )
    if job.objective != "dpo":
        return ""
    if not job.reference_forward:
        return "\n        dpo: reference log-probabilities precomputed (no reference model, no reference forward)"
    held = "a frozen fp32 copy of the model, sharded as the parameters" if job.reference_copy else "LoRA's own base"
    return f"\n        dpo: one reference forward per micro-batch (no gradients); the reference is {held}"
