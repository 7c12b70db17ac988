"""`meshlm plan --validate`: run every layout that fits here for a few steps and compare with the plan.

Each layout runs through the real trainer (`meshlm train --nproc N` in a child process, train_child.py, CPU/gloo
ranks here, GPUs where present) with `--measure-step` on its last step, so every rank writes
what it measured (see train/probe.py). Per rank (its pipeline stage decides the prediction) and
per quantity the ratio predicted / measured is shown; the worst rank counts. Targets: model
states within 3%, communication payload per kind of collective within 5%, peak activations
within 20%.

Every candidate layout is validated when it fits here, except CPU offload without CUDA.
Activation checkpointing is validated when asked for (--activation-checkpointing full).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from meshlm import train_child
from meshlm.config import to_args
from meshlm.errors import MeshlmError
from meshlm.plan import advisor, compare_table, inputs, memory
from meshlm.plan.advisor import Candidate, Estimate
from meshlm.plan.job import train_keys

TARGETS = {"model states": 0.03, "activation peak": 0.20, "comm": 0.05}
# The planner leaves out collectives of a few scalars (the logged loss, the gradient norm under TP, the
# non-finite check, the loss broadcast from the last pipeline stage): a comm row may differ by this many bytes.
SCALAR_SLACK = 1024
# The planner says all_gather for ZeRO-1's parameter redistribution, which ZeroRedundancyOptimizer
# does with one broadcast per rank's partition: same payload, so the two are compared together. Likewise FSDP
# on CPU ranks reduce-scatters with one in-place reduce per rank's chunk (parallel/fsdp.py InPlaceReduceScatter).
KIND_ROWS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather/broadcast",
    "broadcast": "all_gather/broadcast",
    "reduce_scatter": "reduce_scatter/reduce",
    "reduce": "reduce_scatter/reduce",
    "p2p": "p2p",
    "all_to_all": "all_to_all",
}


def local_budget(nproc: int) -> int:
    """Memory one local rank may use: a GPU's, or a fair half-share of the free RAM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return free // (2 * nproc)


def runnable(cand: Candidate) -> str | None:
    """Why meshlm cannot run this layout here, or None."""
    if cand.offload and not torch.cuda.is_available():
        return "CPU offload needs GPUs"
    return None


def validate(args) -> int:
    """Run each layout that fits here through the real trainer and compare; 0 when every one meets the targets."""
    if args.nproc < 1 or args.steps < 2:
        raise MeshlmError("--validate needs --nproc >= 1 and --steps >= 2 (the last step is measured)")
    if "seq_length" not in vars(args):
        args.seq_length = 64  # small enough for CPU ranks
    if args.activation_checkpointing == "auto":
        args.activation_checkpointing = "none"
    spec, job, ests = _candidates(args)
    if not spec.run_as or (spec.run_as[0] == "--model-name" and not Path(spec.run_as[1]).is_dir()):
        raise MeshlmError(
            f"--validate trains {spec.name} here: use the built-in model (no --model-name, with --arch.layers, "
            f"--arch.hidden-size, --arch.heads, --arch.kv-heads, --arch.intermediate-size) or a local model directory"
        )
    todo, skipped = [], []
    for e in ests:
        why = runnable(e.candidate) or (
            None
            if e.fits
            else f"needs {advisor.gib(e.memory.gpu_total)} per rank, more "
            f"than the {advisor.gib(e.budget)} available here"
        )
        (skipped if why else todo).append((e, why))
    if not todo:
        raise MeshlmError(
            "no candidate layout can run here: " + "; ".join(f"{e.candidate.name}: {w}" for e, w in skipped)
        )
    base = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="meshlm-validate-"))
    results = []
    todo.sort(key=lambda x: x[0].candidate.world)
    try:
        for e, _ in todo:
            if not args.json:
                print(f"running {e.candidate.name} on {e.candidate.world} rank(s) ...", flush=True)
            results.append(run_layout(spec, job, e, args.steps, base / e.candidate.name.replace(" ", "_")))
    finally:
        if not args.output_dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.simulate:  # the simulation of each layout's ranks against what they measured
        from meshlm.plan import simulate_check

        simulate_check.add_simulated(spec, job, [e for e, _ in todo], results, TARGETS)
    return _report(args, spec, [e for e, _ in todo], skipped, results)


def _candidates(args) -> tuple:
    """(spec, job, estimates) of the layouts of --nproc ranks, and of the one-rank baseline beside them."""
    ests = []
    wants_single = args.nproc > 1 and (not args.strategy or "single" in args.strategy.split(","))
    try:
        spec, cluster, job, layouts = inputs.inputs(args, world=args.nproc, gpu_memory=str(local_budget(args.nproc)))
        ests += [advisor.estimate(spec, job, cluster, lay, args.efficiency) for lay in layouts]
    except MeshlmError:
        if not wants_single:
            raise
    if wants_single:  # the one-rank baseline, next to the layouts of --nproc ranks
        spec, cluster, job, layouts = inputs.inputs(args, world=1, gpu_memory=str(local_budget(1)))
        ests += [advisor.estimate(spec, job, cluster, lay, args.efficiency) for lay in layouts]
    return spec, job, [e for e in ests if e is not None]


def _report(args, spec, ran: list[Estimate], skipped: list, results: list[dict]) -> int:
    """Print the comparison (table or --json, the simulation's, the plot's path); 1 if a layout missed a target."""
    ok = all(r["ok"] for r in results)
    picture = plot(args, spec, ran, results) if args.plot else None
    if args.json:
        print(
            json.dumps(
                {
                    "results": results,
                    "skipped": {e.candidate.name: w for e, w in skipped},
                    **({"plot": str(picture)} if picture else {}),
                },
                indent=1,
            )
        )
    else:
        print(render(results, skipped))
        if args.simulate:
            from meshlm.plan.simulate_check import render as render_simulated

            print("\n" + render_simulated(results))
        if picture:
            print(f"plot: {picture}")
    return 0 if ok else 1


def plot(args, spec, ests: list[Estimate], results: list[dict]) -> Path:
    """The predictions of the layouts that ran, each with the most a rank measured beside it."""
    measured = {r["layout"]: r["measured_bytes"] for r in results if "measured_bytes" in r}
    ranks = f"{args.nproc} {'GPU' if torch.cuda.is_available() else 'CPU'} rank(s)"
    return inputs.plot(
        args,
        {e.candidate.name: e.memory for e in ests},
        local_budget(args.nproc),
        f"predicted memory per rank vs measured on {ranks} here; model {spec.name}",
        measured=measured,
        limit_label=f"memory per rank here ({args.nproc} ranks)",
        measured_label="measured: model states + activation peak\n(fullest rank; buffers not measured)",
    )


def train_command(spec, job, e: Estimate, steps: int, out: Path) -> list[str]:
    nproc = ["--nproc", str(e.candidate.world)] if e.candidate.world > 1 else []  # one rank: the subprocess is it
    cmd = [*nproc, *spec.run_as, *to_args(train_keys(job, e))]
    samples = max(400, 2 * job.global_batch * job.seq_length // 64)
    return [
        sys.executable,
        "-m",
        "meshlm",
        "train",
        *cmd,
        "--max-steps",
        str(steps),
        "--measure-step",
        str(steps),
        "--log-every",
        "1",
        "--warmup-steps",
        "1",
        "--progress",
        "false",
        "--save-final",
        "false",
        "--resume",
        "false",
        "--builtin-samples",
        str(samples),
        "--output-dir",
        str(out),
    ]


def run_layout(spec, job, e: Estimate, steps: int, out: Path) -> dict:
    cmd = train_command(spec, job, e, steps, out)
    p = train_child.run(cmd[4:])
    result = {"layout": e.candidate.name, "command": cmd[3:], "rows": [], "ok": False}
    probes = sorted(out.glob("probe/rank-*.json"))
    if p.returncode != 0 or len(probes) != e.candidate.world:
        lines = (p.stderr or p.stdout).strip().splitlines()
        said = [
            ln for ln in lines if ln.startswith("meshlm: error:") or (ln.startswith("meshlm: rank") and " failed" in ln)
        ]
        result["error"] = (said or lines or [f"exit status {p.returncode}"])[-1]
        return result
    measured = [json.loads(f.read_text()) for f in probes]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result["metrics_model_state_bytes"] = metrics[-1]["model_state_bytes"]
    # what --plot draws beside the prediction: the fullest rank's states and activation peak
    result["measured_bytes"] = max(m["model_state_bytes"] + m["activation_peak_bytes"] for m in measured)
    result["rows"] = compare(e, measured)
    result["probes"] = measured
    result["ok"] = all(r["ok"] for r in result["rows"])
    return result


def compare(e: Estimate, measured: list[dict]) -> list[dict]:
    """Rows (quantity, predicted, measured, ratio) for the rank furthest from its prediction."""
    per_stage = e.candidate.world // e.candidate.pp  # ranks per pipeline stage (pp is the outermost mesh dimension)
    dispatched = _mean_all_to_all(measured, per_stage)
    # The probe's activation peak is what the step allocates and frees, FSDP2's buffer of accumulated gradients too
    # (bf16 zero2's master-weights engine accumulates in the parameters' .grad, which the probe files as gradients)
    worst: dict[str, dict] = {}
    for m in measured:
        mem, comm = e.stages[m["rank"] // per_stage]
        peak = mem.act.peak + mem.temp.get(memory.ACCUMULATED, 0)
        predicted = {"model states": sum(mem.states.values()), "activation peak": peak}
        got = {"model states": m["model_state_bytes"], "activation peak": m["activation_peak_bytes"]}
        for c in comm:
            if c.kind in KIND_ROWS:
                key = f"comm {KIND_ROWS[c.kind]}"
                predicted[key] = predicted.get(key, 0) + c.payload
        for kind, v in m["comm"].items():
            key = f"comm {KIND_ROWS.get(kind, kind)}"
            got[key] = got.get(key, 0) + v["payload"]
        if "comm all_to_all" in got:
            got["comm all_to_all"] = dispatched[m["rank"] // per_stage]
        for key in predicted.keys() | got.keys():
            pr, me = predicted.get(key, 0), got.get(key, 0)
            ratio = pr / me if me else (1.0 if pr == 0 else float("inf"))
            target = TARGETS["comm" if key.startswith("comm") else key]
            ok = abs(ratio - 1) <= target or (key.startswith("comm") and abs(pr - me) <= SCALAR_SLACK)
            row = {
                "quantity": key,
                "rank": m["rank"],
                "predicted": pr,
                "measured": me,
                "ratio": ratio,
                "target": target,
                "ok": ok,
            }
            if key not in worst or (not ok, abs(ratio - 1)) > (not worst[key]["ok"], abs(worst[key]["ratio"] - 1)):
                worst[key] = row
    order = ["model states", "activation peak"]
    return sorted(
        worst.values(), key=lambda r: (order.index(r["quantity"]) if r["quantity"] in order else 2, r["quantity"])
    )


def _mean_all_to_all(measured: list[dict], per_stage: int) -> dict[int, float]:
    """Per pipeline stage, the all-to-all bytes its ranks send on average. A rank sends its tokens' k copies out
    and the results of the tokens routed to its experts back, so its share follows the router (a random one
    sends one rank up to 1.32x the balanced share, measured), while the ranks' total does not;
    the plan prices a balanced router, which their mean measures. (Context parallel's all-to-alls are equal.)"""
    sums: dict[int, list[float]] = {}
    for m in measured:
        sent = sum(v["payload"] for kind, v in m["comm"].items() if KIND_ROWS.get(kind, kind) == "all_to_all")
        sums.setdefault(m["rank"] // per_stage, []).append(sent)
    return {stage: sum(v) / len(v) for stage, v in sums.items()}


def render(results: list[dict], skipped) -> str:
    lines = compare_table.head(
        "predicted vs measured (bytes per rank per step; the rank furthest from its prediction)", "predicted"
    )
    for r in results:
        if "error" in r:
            lines.append(f"{r['layout']:<22} FAILED: {r['error']}")
            continue
        for row in r["rows"]:
            flag = "" if row["ok"] else "  <-- outside target"
            if row["ok"] and abs(row["ratio"] - 1) > row["target"]:
                flag = "  (scalars only)"
            lines.append(compare_table.row(r["layout"], row, "predicted", flag))
    for e, why in skipped:
        lines.append(f"{e.candidate.name:<22} not run: {why}")
    bad = [r["layout"] for r in results if not r["ok"]]
    lines.append("all within target" if not bad else f"outside target or failed: {', '.join(bad)}")
    return "\n".join(lines)
