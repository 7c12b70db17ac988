"""Full fine-tuning against LoRA (r = 8, r = 64) under ddp and zero3 on CPU ranks (gloo).

    PYTHONPATH=src python benchmarks/lora.py [--ranks 2] [--steps 12] [--hidden 256 --layers 4]

One table: tokens/s after the warm-up interval, rank 0's model-state bytes (parameters + gradients +
optimizer states, local shards; with LoRA also split into frozen base / adapters / adapter gradients /
adapter optimizer states) and rank 0's peak resident memory. Same model, data and global batch in every
row; each row is the faster of --repeats runs (the machine may be shared).
"""

from __future__ import annotations

import argparse

from harness import summary, train_rows
from sharded_memory import model_args

MiB = 2**20


def run(a, strategy: str, r: int) -> dict:
    # the model and data sharded_memory.py measures, global batch 16; the first logged interval is the warm-up
    rows = train_rows(a.ranks, a.steps, a.steps // 3, 16 // a.ranks, "--strategy", strategy, *model_args(a),
                      "--lora.r", str(r))  # fmt: skip
    s = summary(rows, a.steps // 3)
    return {**rows[-1], "tokens_per_s": s["tokens_per_s"], "peak": s["peak_bytes"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    print(f"{a.ranks} CPU ranks, hidden {a.hidden}, {a.layers} layers, global batch 16 x 128 tokens, {a.steps} steps")
    print(
        "| strategy | fine-tuning | tokens/s | model state / rank (MiB) | frozen | adapters | grads | optim | "
        "peak RSS rank 0 (MiB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for strategy in ("ddp", "zero3"):
        for r in (0, 8, 64):
            row = max((run(a, strategy, r) for _ in range(a.repeats)), key=lambda x: x["tokens_per_s"])
            kinds = " | ".join(
                f"{row[k] / MiB:.2f}" if k in row else "-"
                for k in ("frozen_bytes", "adapter_bytes", "grad_bytes", "optim_bytes")
            )
            print(
                f"| {strategy} | {'full' if r == 0 else f'LoRA r={r}'} | {row['tokens_per_s']:,.0f} | "
                f"{row['model_state_bytes'] / MiB:.2f} | {kinds} | {row['peak'] / MiB:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
