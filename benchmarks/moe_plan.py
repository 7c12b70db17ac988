"""`meshlm plan` for the two mixture-of-experts presets on 64 to 512 H100s: the fastest layout that
fits, the fastest with expert parallel, and what expert parallel costs in all-to-all time; then the timed
`plan --simulate` of the Qwen3-235B-A22B preset on 8 x 8 GPUs against its analytic model states.

Defaults of `meshlm plan` (bf16, AdamW, sequence 2048, micro-batch 1, global batch 64 x GPUs / 64, 10% margin).

    python benchmarks/moe_plan.py                  # the table and the timed --simulate (about 5 minutes)
    python benchmarks/moe_plan.py --skip-simulate  # the table only
    python benchmarks/moe_plan.py --skip-table     # the --simulate runs only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from meshlm.cli import build_parser
from meshlm.plan import advisor
from meshlm.plan.cli import inputs

GiB = 2**30
PRESETS = ("qwen3-235b-a22b", "deepseek-v3")
GPUS = (64, 128, 256, 512)


def plan(model: str, gpus: int) -> advisor.Plan:
    ns = build_parser().parse_args(
        ["plan", "--model", model, "--nodes", str(gpus // 8), "--gpus-per-node", "8", "--global-batch-size", str(gpus)]
    )
    spec, cluster, job, layouts = inputs(ns)
    return advisor.plan(spec, job, cluster, layouts, ns.efficiency)


def _a2a_s(e) -> float:
    return sum(c.seconds for c in e.comm if c.kind == "all_to_all")


def _cells(e) -> str:
    if e is None:
        return f"{'none fits':<28} {'':>8} {'':>7} {'':>10} {'':>5} {'':>8}"
    return (
        f"{e.candidate.name:<28} {e.memory.gpu_total / GiB:>7.1f}G {e.step_s:>7.2f} {e.tokens_per_s:>10,.0f} "
        f"{e.mfu:>5.0%} {_a2a_s(e) * 1e3:>7.0f}ms"
    )


def table() -> None:
    head = f"{'layout':<28} {'GPU mem':>8} {'step s':>7} {'tokens/s':>10} {'MFU':>5} {'all2all':>8}"
    print(f"{'model':<16} {'GPUs':>5} | fastest that fits: {head} | fastest with ep: {head}")
    for model in PRESETS:
        for gpus in GPUS:
            result = plan(model, gpus)
            best = result.ranked[0] if result.ranked else None
            with_ep = next((e for e in result.ranked if e.candidate.ep > 1), None)
            print(f"{model:<16} {gpus:>5} | {'':>19}{_cells(best)} | {'':>17}{_cells(with_ep)}")


def simulate(extra: list[str]) -> None:
    """The whole command as a user runs it, timed; each simulated rank's model states against the plan's."""
    args = ["plan", "--model", "qwen3-235b-a22b", "--nodes", "8", "--gpus-per-node", "8", *extra, "--simulate"]
    started = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "meshlm", *args, "--json"], capture_output=True, text=True)
    took = time.perf_counter() - started
    if p.returncode:
        raise SystemExit(f"meshlm {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    print(f"meshlm {' '.join(args)}: {took:.0f} s")
    for r in json.loads(p.stdout)["simulated"]:
        if "skipped" in r:
            print(f"  {r['layout']}: not simulated: {r['skipped']}")
            continue
        sim, planned = r["model_states"], r["plan"]["model_states"]
        print(
            f"  {r['layout']} rank {r['rank']} (stage {r['stage']}): model states {sim / GiB:.2f} GiB simulated, "
            f"{planned / GiB:.2f} GiB planned ({sim / planned - 1:+.2%}); peak {r['peak'] / GiB:.2f} GiB "
            f"simulated, {r['plan']['peak'] / GiB:.2f} GiB planned"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-simulate", action="store_true")
    parser.add_argument("--skip-table", action="store_true")
    args = parser.parse_args()
    if not args.skip_table:
        table()
    if not args.skip_simulate:
        simulate([])  # the plan's winner
        simulate(["--ep", "64", "--tp", "1"])  # the fastest expert-parallel layout without TP


if __name__ == "__main__":
    main()
