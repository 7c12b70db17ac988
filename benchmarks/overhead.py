"""meshlm's overhead against minimal hand-written PyTorch loops: ddp, zero3 and tp on 2 CPU ranks.

    python benchmarks/overhead.py [--steps 60] [--warmup 10] [--repeats 3] [--layouts ddp,zero3,tp]

Same model (the built-in default), data, global batch (16 sequences) and step count; one thread
per rank. ddp and zero3 take micro-batches of 8 on each of 2 data-parallel ranks; tp has one
data-parallel rank, so both ranks take the same 16. A layout this tree's meshlm cannot run yet
is listed as not available, never measured with something else in its place.
Target: meshlm >= 0.97 of the hand-written loop's tokens/s.
"""

from __future__ import annotations

import argparse
from functools import partial

from harness import HERE, available, best, mib, script, torchrun, train

LAYOUTS = {  # name: (meshlm train options, micro-batch per rank)
    "ddp": (["--strategy", "ddp"], 8),
    "zero3": (["--strategy", "zero3"], 8),
    "tp": (["--parallel.tp", "2"], 16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="ddp,zero3,tp")
    args = ap.parse_args()
    assert args.steps % args.warmup == 0, "--steps must be a multiple of --warmup"
    print(
        f"overhead: built-in model, global batch 16, {args.steps} steps ({args.warmup} warm-up), 2 ranks, "
        f"1 thread per rank, best of {args.repeats}; memory = rank 0's peak RSS"
    )
    print(
        f"{'layout':<8}{'hand-written tok/s':>20}{'meshlm tok/s':>14}{'ratio':>7}{'hand MiB':>10}{'meshlm MiB':>12}"
        f"  (target ratio >= 0.97)"
    )
    for name in args.layouts.split(","):
        opts, micro = LAYOUTS[name]
        why = available(name, 2, opts[1] if opts[0] == "--strategy" else "auto", 2 if name == "tp" else 1)
        if why:
            print(f"{name:<8}{why}")
            continue
        hand, mesh = best(
            args.repeats,
            partial(
                script,
                torchrun(2),
                HERE / "handwritten.py",
                "--layout",
                name,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--micro-batch",
                str(micro),
            ),
            partial(train, 2, args.steps, args.warmup, micro, *opts),
        )
        print(
            f"{name:<8}{hand['tokens_per_s']:>20,.0f}{mesh['tokens_per_s']:>14,.0f}"
            f"{mesh['tokens_per_s'] / hand['tokens_per_s']:>7.3f}{mib(hand['peak_bytes']):>10}"
            f"{mib(mesh['peak_bytes']):>12}",
            flush=True,
        )


if __name__ == "__main__":
    main()
