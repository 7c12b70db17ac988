"""MFU and tokens/s of a ~1B Llama-style model in bf16 on one GPU, with and without compile and
activation checkpointing. Skips (exit 0, one line) where no CUDA device is visible.

    python benchmarks/gpu_mfu.py [--steps 30] [--micro-batch 8] [--seq-length 2048]
    python benchmarks/gpu_mfu.py --attention sdpa,flex,varlen      # one row per attention kernel

Model: hidden 2048, 16 blocks, 32 heads / 8 key-value heads, MLP 8192 (Llama 3.2 1B's body;
the built-in byte tokenizer's 320-entry vocabulary instead of 128k, so nearly all FLOPs are in the
blocks): about 0.97B parameters. bf16 compute with fp32 master weights (`--mixed-precision bf16`),
fused AdamW. MFU is meshlm's own figure: 6N + attention FLOPs per token against the GPU's dense
bf16 peak of the exact part (meshlm/hardware.py: 989 TFLOP/s for H100 SXM, 756 for PCIe).
Reference points: torchtitan reports 33-39% MFU for Llama 3 8B with FSDP on H100 without Float8;
the target here is >= 45%.
"""

from __future__ import annotations

import argparse
import sys

import torch
from harness import train

MODEL = [
    "--arch.hidden-size",
    "2048",
    "--arch.layers",
    "16",
    "--arch.heads",
    "32",
    "--arch.kv-heads",
    "8",
    "--arch.intermediate-size",
    "8192",
    "--arch.max-positions",
    "4096",
    "--builtin-samples",
    "20000",
]


def table(steps: int, warmup: int, micro_batch: int, seq_length: int) -> list[dict]:
    """One row per (compile, activation checkpointing): tokens/s, MFU, peak bytes, or the error."""
    rows = []
    for compile_ in ("false", "true"):
        for ac in ("none", "full"):
            row = {"compile": compile_, "ac": ac}
            try:
                row |= train(
                    1,
                    steps,
                    warmup,
                    micro_batch,
                    *MODEL,
                    "--seq-length",
                    str(seq_length),
                    "--mixed-precision",
                    "bf16",
                    "--compile",
                    compile_,
                    "--activation-checkpointing",
                    ac,
                )
            except RuntimeError as e:
                row["error"] = str(e).strip().splitlines()[-1]
            rows.append(row)
    return rows


def kernels(steps: int, warmup: int, micro_batch: int, seq_length: int, choices: list[str], *extra: str) -> list[dict]:
    """One row per --attention kernel on the packed built-in corpus, compiled, bf16: tokens/s, mfu (the scores
    each document needs), mfu_dense (PaLM's figure), peak bytes, or the error."""
    rows = []
    for choice in choices:
        row = {"attention": choice}
        try:
            row |= train(
                1,
                steps,
                warmup,
                micro_batch,
                *MODEL,
                *["--seq-length", str(seq_length), "--mixed-precision", "bf16", "--compile", "true"],
                *["--attention", choice, *extra],
            )
        except RuntimeError as e:
            row["error"] = str(e).strip().splitlines()[-1]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--attention", default="", help="e.g. sdpa,flex,varlen: one row per kernel instead (compiled)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_mfu: skipped: no CUDA device visible (this benchmark needs one GPU)")
        return
    print(
        f"gpu_mfu: ~1B Llama, bf16, micro-batch {args.micro_batch} x {args.seq_length} tokens, {args.steps} steps "
        f"({args.warmup} warm-up), {torch.cuda.get_device_name()}"
    )
    if args.attention:
        print(f"{'attention':<11}{'tokens/s':>10}{'mfu %':>8}{'mfu_dense %':>13}{'peak GiB':>10}")
        for r in kernels(args.steps, args.warmup, args.micro_batch, args.seq_length, args.attention.split(",")):
            if "error" in r:
                print(f"{r['attention']:<11}  failed: {r['error']}", flush=True)
                continue
            print(
                f"{r['attention']:<11}{r['tokens_per_s']:>10,.0f}{100 * r['mfu']:>8.1f}{100 * r['mfu_dense']:>13.1f}"
                f"{r['peak_bytes'] / 2**30:>10.1f}",
                flush=True,
            )
        return
    print(f"{'compile':<9}{'act. ckpt':<11}{'tokens/s':>10}{'MFU %':>8}{'peak GiB':>10}")
    for r in table(args.steps, args.warmup, args.micro_batch, args.seq_length):
        if "error" in r:
            print(f"{r['compile']:<9}{r['ac']:<11}  failed: {r['error']}", flush=True)
            continue
        print(
            f"{r['compile']:<9}{r['ac']:<11}{r['tokens_per_s']:>10,.0f}{100 * r['mfu']:>8.1f}"
            f"{r['peak_bytes'] / 2**30:>10.1f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
