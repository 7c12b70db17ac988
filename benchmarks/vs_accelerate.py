"""meshlm train (its defaults) against the same job written the Accelerate way, on 2 processes.

    python benchmarks/vs_accelerate.py [--steps 60] [--warmup 10] [--repeats 3] [--compile]

The Accelerate side is benchmarks/accelerate_job.py under `accelerate launch` (DDP: --multi_gpu
launcher; FSDP: --use_fsdp --fsdp_version 2, block-wise auto wrap, reshard after forward). On a
machine without CUDA both sides run CPU processes with gloo, one OpenMP thread each. Reported:
tokens/s after warm-up, rank 0's peak memory, the final loss (mean of the last interval), and
meshlm / Accelerate throughput. Target: >= 1.2x with equal or lower memory. --compile adds a row for
`meshlm train --compile true` (steady tokens/s; the warm-up interval holds the compile, its time is printed).
A side that cannot run the layout says so (meshlm: verify's availability check; Accelerate:
the distributed type it reports, since it falls back to DDP where FSDP is not supported).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
from runner import HERE, available, best, meshlm, mib, script

FSDP_FLAGS = [
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "LlamaDecoderLayer",
    "--fsdp_reshard_after_forward",
    "true",
]


def accelerate(layout: str, steps: int, warmup: int) -> dict:
    launch = [
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
    ]
    launch += FSDP_FLAGS if layout == "fsdp" else ["--multi_gpu"]
    cpu = [] if torch.cuda.is_available() else ["--cpu"]
    return script(
        launch, HERE / "accelerate_job.py", *cpu, "--steps", str(steps), "--warmup", str(warmup), "--micro-batch", "8"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="ddp,fsdp")
    ap.add_argument("--compile", action="store_true", help="also run meshlm with --compile (one more row per layout)")
    args = ap.parse_args()
    assert args.steps % args.warmup == 0, "--steps must be a multiple of --warmup"
    print(
        f"vs Accelerate: built-in model, micro-batch 8 x 2 processes, {args.steps} steps ({args.warmup} warm-up), "
        f"1 thread per process, best of {args.repeats}; memory = rank 0's peak"
    )
    print(f"{'layout':<8}{'side':<12}{'tokens/s':>10}{'peak MiB':>10}{'final loss':>12}  notes")
    for layout in args.layouts.split(","):
        why = available(layout, 2, "auto" if layout == "ddp" else layout)
        extra = [] if layout == "ddp" else ["--strategy", layout]  # ddp is what meshlm picks for 2 ranks
        jobs = [partial(accelerate, layout, args.steps, args.warmup)]
        if not why:
            jobs.append(partial(meshlm, 2, args.steps, args.warmup, 8, *extra))
            if args.compile:
                jobs.append(partial(meshlm, 2, args.steps, args.warmup, 8, *extra, "--compile", "true"))
        acc, *ours = best(args.repeats, *jobs)
        kind = acc["distributed_type"].split(".")[-1]
        fell_back = layout == "fsdp" and kind != "FSDP"
        note = f"Accelerate ran {kind}: no FSDP on this device type" if fell_back else kind
        print(
            f"{layout:<8}{'accelerate':<12}{acc['tokens_per_s']:>10,.0f}{mib(acc['peak_bytes']):>10}"
            f"{acc['loss']:>12.4f}  {note}",
            flush=True,
        )
        if why:
            print(f"{layout:<8}{'meshlm':<12}  {why}")
            continue
        for side, run in zip(("meshlm", "+compile"), ours):
            ratio = run["tokens_per_s"] / acc["tokens_per_s"]
            mem = "lower" if run["peak_bytes"] <= acc["peak_bytes"] else "HIGHER"
            took = (
                f"; its first {args.warmup} steps (compiling) took {run['warmup_s']:.0f} s" if side != "meshlm" else ""
            )
            print(
                f"{layout:<8}{side:<12}{run['tokens_per_s']:>10,.0f}{mib(run['peak_bytes']):>10}"
                f"{run['loss']:>12.4f}  {ratio:.2f}x Accelerate's tokens/s (target >= 1.2), memory {mem}"
                f"{' (Accelerate was not sharding)' if fell_back else ''}{took}",
                flush=True,
            )


if __name__ == "__main__":
    main()
