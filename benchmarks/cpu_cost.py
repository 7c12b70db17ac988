"""CPU time per optimizer step (all ranks together) of meshlm, Accelerate and the hand-written loop.

    python benchmarks/cpu_cost.py [--short 20] [--long 60] [--repeats 2] [--job builtin|alpaca]

Tokens/s on a shared machine measures the other tenants as much as the code. CPU seconds do
not: each job runs twice (--short and --long steps, DDP on 2 CPU processes, one thread each,
the built-in default job), and the difference of its processes' CPU time (user + system, from
getrusage of the children) over the extra steps is the work one step costs, with start-up,
imports and data preparation cancelled out. Lower is better; equal means the same work.
--job alpaca: vs_accelerate.py's Alpaca job (a local Llama of hidden 256 x 4, an Alpaca JSONL; the Accelerate
side concatenates records into blocks), with a row for `--attention varlen` beside meshlm's default.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from harness import HERE, run_job, torchrun, train_command
from vs_accelerate import alpaca_job


def cpu_seconds(cmd: list[str]) -> float:
    return run_job(cmd)["cpu_s"]


def jobs(steps: int, data: list[str]) -> dict[str, list[str]]:
    common = ["--steps", str(steps), "--warmup", "10", *data]
    out_dir = tempfile.mkdtemp(prefix="meshlm-cpu-cost-")
    meshlm = train_command(out_dir, 2, steps, None, None, *(["--strategy", "ddp", *data] if data else []))
    out = {"meshlm train --nproc 2": meshlm}
    if data:
        out["meshlm --attention varlen"] = [*meshlm, "--attention", "varlen"]
    out |= {
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
    }
    if not data:
        out["hand-written DDP"] = [*torchrun(2), str(HERE / "handwritten.py"), "--layout", "ddp", *common]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", type=int, default=20)
    ap.add_argument("--long", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--job", choices=("builtin", "alpaca"), default="builtin")
    ap.add_argument("--records", type=int, default=3000, help="--job alpaca: records in the generated JSONL")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        data = alpaca_job(Path(root), args.records) if args.job == "alpaca" else []
        compare(args, data)


def compare(args, data: list[str]) -> None:
    what = f"the Alpaca job ({args.records} records)" if data else "built-in model"
    print(
        f"cpu cost: {what}, DDP, micro-batch 8 x 2 processes, 1 thread each; CPU ms per step = "
        f"(CPU s of a {args.long}-step run - a {args.short}-step run) / {args.long - args.short}, best of "
        f"{args.repeats}"
    )
    for name in jobs(1, data):
        costs = []
        for _ in range(args.repeats):
            extra = cpu_seconds(jobs(args.long, data)[name]) - cpu_seconds(jobs(args.short, data)[name])
            costs.append(1000 * extra / (args.long - args.short))
        print(f"{name:<26}{min(costs):>8.0f} CPU ms/step   (runs: {', '.join(f'{c:.0f}' for c in costs)})", flush=True)


if __name__ == "__main__":
    main()
