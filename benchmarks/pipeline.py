"""Pipeline bubble: measured against the formula (P-1)/(M+P-1), for P = 2, 4 stages and M = 1, 2, 4, 8
micro-batches, under GPipe and 1F1B.

    python benchmarks/pipeline.py [--steps 12] [--log-every 4] [--hidden 256]

Each point is a real `meshlm train --nproc P --parallel.pp P` run on CPU ranks (one thread each). The
bubble is what the pipeline engine records in metrics.jsonl: 1 - (time inside the stages' forwards and
backwards) / (the pipeline's span of actions, first start to last end), averaged over the pipeline's
ranks and over the logged intervals after the first (which holds shape inference and warm-up). Every
pipeline micro-batch has 2 sequences, so the work per micro-batch is the same at every M. Target: within
5 percentage points of the formula for M >= 4. 1F1B needs M >= P (fewer is refused in one line), shown
as "-". With more ranks than cores the ranks share cores: a stage's compute stretches when its
neighbours compute at the same time, which the formula (equal, fixed stage times) does not model.
"""

from __future__ import annotations

import argparse
import os

from harness import train_rows


def bubble(pp: int, m: int, schedule: str, args) -> float | None:
    if schedule == "1f1b" and m < pp:
        return None
    h = args.hidden
    rows = train_rows(
        pp,
        args.steps,
        args.log_every,
        2 * m,
        *["--parallel.pp", str(pp), "--parallel.micro-batches", str(m), "--parallel.schedule", schedule],
        *["--arch.hidden-size", str(h), "--arch.layers", "8", "--arch.heads", "8", "--arch.kv-heads", "8"],
        *["--arch.intermediate-size", str(4 * h), "--seq-length", "128", "--builtin-samples", "2000"],
    )
    timed = rows[1:]
    return sum(r["pp_bubble"] for r in timed) / len(timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    assert args.steps % args.log_every == 0 and args.steps > args.log_every
    print(
        f"pipeline bubble: Llama, 8 layers, hidden {args.hidden}, seq 128, 2 sequences per micro-batch, "
        f"{args.steps} steps ({args.log_every} warm-up), CPU ranks ({os.cpu_count()} cores), one thread each"
    )
    print(f"{'P':>2} {'M':>2} {'formula':>8} {'gpipe':>8} {'1f1b':>8}   gap (points)")
    for pp in (2, 4):
        for m in (1, 2, 4, 8):
            formula = (pp - 1) / (m + pp - 1)
            got = {s: bubble(pp, m, s, args) for s in ("gpipe", "1f1b")}
            cells = "".join(f"{g:>8.3f}" if g is not None else f"{'-':>8}" for g in got.values())
            gaps = " ".join(f"{s} {100 * (g - formula):+.1f}" for s, g in got.items() if g is not None)
            print(f"{pp:>2} {m:>2} {formula:>8.3f} {cells}   {gaps}", flush=True)


if __name__ == "__main__":
    main()
