"""CPU time per optimizer step (all ranks together) of meshlm, Accelerate and the hand-written loop.

    python benchmarks/cpu_cost.py [--short 20] [--long 60] [--repeats 2]

Tokens/s on a shared machine measures the other tenants as much as the code. CPU seconds do
not: each job runs twice (--short and --long steps, DDP on 2 CPU processes, one thread each,
the built-in default job), and the difference of its processes' CPU time (user + system, from
getrusage of the children) over the extra steps is the work one step costs, with start-up,
imports and data preparation cancelled out. Lower is better; equal means the same work.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile

from runner import ENV, HERE, torchrun


def cpu_seconds(cmd: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=ENV, capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def jobs(steps: int) -> dict[str, list[str]]:
    common = ["--steps", str(steps), "--warmup", "10"]
    return {
        "meshlm train --nproc 2": [
            sys.executable,
            "-m",
            "meshlm",
            "train",
            "--nproc",
            "2",
            "--omp-threads",
            "1",
            "--max-steps",
            str(steps),
            "--progress",
            "false",
            "--save-final",
            "false",
            "--output-dir",
            tempfile.mkdtemp(prefix="meshlm-cpu-cost-"),
        ],
        "accelerate launch (DDP)": [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--multi_gpu",
            str(HERE / "accelerate_job.py"),
            "--cpu",
            *common,
        ],
        "hand-written DDP": [*torchrun(2), str(HERE / "handwritten.py"), "--layout", "ddp", *common],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", type=int, default=20)
    ap.add_argument("--long", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(
        f"cpu cost: built-in model, DDP, micro-batch 8 x 2 processes, 1 thread each; CPU ms per step = "
        f"(CPU s of a {args.long}-step run - a {args.short}-step run) / {args.long - args.short}, best of "
        f"{args.repeats}"
    )
    for name in jobs(1):
        costs = []
        for _ in range(args.repeats):
            extra = cpu_seconds(jobs(args.long)[name]) - cpu_seconds(jobs(args.short)[name])
            costs.append(1000 * extra / (args.long - args.short))
        print(f"{name:<26}{min(costs):>8.0f} CPU ms/step   (runs: {', '.join(f'{c:.0f}' for c in costs)})", flush=True)


if __name__ == "__main__":
    main()
