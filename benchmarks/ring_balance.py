"""Ring attention's per-rank work under a causal mask: consecutive tokens against zig-zag chunks.

Each cp rank's attention compute (parallel/ring.py's forward merge and backward gradient of every block it meets
on the ring) timed in one process, rank by rank, without the communication (the blocks are handed over
directly), so the table shows the work each rank does, not its waiting: under consecutive tokens the last rank's
queries see every key and the first rank's only its own, and the ring's step time is the slowest rank's. fp32,
one sequence of --seq tokens (one document, or --documents packed ones of equal length), --heads heads of 64,
one OpenMP thread. Times are the best of --repeats per rank; the score elements each rank computes (the mask's
spans, machine-independent) are counted as well.

    python benchmarks/ring_balance.py [--seq 8192] [--cp 4] [--heads 4] [--documents 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from meshlm.parallel.context import SequenceSplit
from meshlm.parallel.ring import RingShape, _grad_block, _merge_block, _tiles


def rank_work(q, k, v, documents, cp: int, rank: int, zigzag: bool) -> tuple[float, int]:
    """Seconds of rank `rank`'s forward and backward attention compute, and its score elements."""
    splits = [SequenceSplit(None, r, cp, zigzag) for r in range(cp)]
    local = [[sp.local(t.transpose(1, 2)).transpose(1, 2).unsqueeze(2) for t in (q, k, v)] for sp in splits]
    shape = RingShape(None, rank, cp, documents, None, q.shape[-1] ** -0.5, None, zigzag)
    ql = local[rank][0]
    elements = 0
    for src in range(cp):
        for q0, q1 in _tiles(ql, ql.shape[3], zigzag):
            allowed = shape.allowed(q0, q1, src)
            elements += 0 if allowed is None else (q1 - q0) * (allowed[1].stop - allowed[1].start) * ql.shape[1]
    start = time.perf_counter()
    out, lse = torch.zeros_like(ql), torch.full(ql.shape[:-1], float("-inf"))
    for src in range(cp):
        _merge_block(shape, ql, local[src][1], local[src][2], out, lse, src)
    grad, dq = torch.ones_like(out), torch.zeros_like(ql)
    for src in range(cp):
        dk, dv = torch.zeros_like(local[src][1]), torch.zeros_like(local[src][2])
        _grad_block(shape, (ql, out, lse, grad), local[src][1], local[src][2], dq, dk, dv, src)
    return time.perf_counter() - start, elements


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--documents", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, 64) for _ in range(3))
    documents = (torch.arange(args.seq) * args.documents // args.seq)[None]
    best: dict[tuple[bool, int], tuple[float, int]] = {}
    for i in range(args.repeats):
        for zigzag in (False, True) if i % 2 == 0 else (True, False):
            for rank in range(args.cp):
                t, n = rank_work(q, k, v, documents, args.cp, rank, zigzag)
                best[zigzag, rank] = (min(t, best.get((zigzag, rank), (t, n))[0]), n)
    load = os.getloadavg()[0]
    print(f"seq {args.seq}, cp {args.cp}, {args.heads} heads, {args.documents} document(s), load {load:.1f}")
    print("| split | " + " | ".join(f"rank {r} s (M scores)" for r in range(args.cp)) + " | slowest / mean |")
    print("|---|" + "---|" * (args.cp + 1))
    for zigzag in (False, True):
        times = [best[zigzag, r][0] for r in range(args.cp)]
        cells = " | ".join(f"{best[zigzag, r][0]:.3f} ({best[zigzag, r][1] / 1e6:.1f})" for r in range(args.cp))
        name = "zig-zag" if zigzag else "consecutive"
        print(f"| {name} | {cells} | {max(times) / (sum(times) / len(times)):.2f} |")


if __name__ == "__main__":
    main()
