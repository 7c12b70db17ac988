"""Weak scaling of ddp and zero3 over 1, 2 and 4 CPU ranks: tokens/s and efficiency.

    python benchmarks/scaling.py [--steps 40] [--warmup 10] [--repeats 2] [--ranks 1,2,4]

Each rank takes micro-batches of 8 (the global batch grows with the ranks), one OpenMP thread
per rank. Efficiency at N ranks = tokens/s(N) / (N x tokens/s(1)); the 1-rank run is `meshlm
train` in one process (strategy single) for both rows. On a machine with fewer cores than ranks
the extra ranks share cores (oversubscription) and efficiency measures that, not the code:
the header prints the core count. Target: ddp efficiency >= 0.85 from 1 to 2 ranks (on >= 2 free cores).
"""

from __future__ import annotations

import argparse
import os
from functools import partial

from harness import available, best, train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ranks", default="1,2,4")
    args = ap.parse_args()
    ranks = [int(n) for n in args.ranks.split(",")]
    cores = os.cpu_count() or 1
    note = f"; {max(ranks)} ranks on {cores} cores oversubscribe" if max(ranks) > cores else ""
    print(
        f"scaling: built-in model, micro-batch 8 per rank, {args.steps} steps ({args.warmup} warm-up), "
        f"1 thread per rank, best of {args.repeats}{note}"
    )
    [one] = best(args.repeats, partial(train, 1, args.steps, args.warmup, 8))
    one = one["tokens_per_s"]
    print(f"{'strategy':<10}{'ranks':>6}{'tokens/s':>12}{'efficiency':>12}")
    print(f"{'single':<10}{1:>6}{one:>12,.0f}{1.0:>12.2f}", flush=True)
    for strategy in ("ddp", "zero3"):
        for n in (r for r in ranks if r > 1):
            why = available(strategy, n, strategy, global_batch=8 * n)
            if why:
                print(f"{strategy:<10}{n:>6}  {why}")
                continue
            [run] = best(args.repeats, partial(train, n, args.steps, args.warmup, 8, "--strategy", strategy))
            tps = run["tokens_per_s"]
            print(f"{strategy:<10}{n:>6}{tps:>12,.0f}{tps / (n * one):>12.2f}", flush=True)


if __name__ == "__main__":
    main()
