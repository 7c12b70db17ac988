"""Memory per rank and throughput of the sharded data-parallel strategies on CPU ranks (gloo).

    PYTHONPATH=src python benchmarks/sharded_memory.py [--ranks 4] [--steps 20] [--hidden 256 --layers 4]

Table 1, on --ranks ranks: measured model_state_bytes of rank 0 (local shards of parameters,
gradients, optimizer states; see Engine.model_state_bytes), the ZeRO paper's formula for fp32
Adam with P parameters and N data-parallel ranks, their ratio, and tokens/s.
Table 2, on 2 ranks: zero3 tokens/s over ddp tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from harness import train_rows


def formula(strategy: str, psi: int, n: int, shard: int) -> float:
    return {
        "ddp": 16 * psi,
        "zero1": 8 * psi + 8 * psi / n,
        "zero2": 4 * psi + 12 * psi / n,
        "zero3": 16 * psi / n,
        "hsdp": 16 * psi / shard,
    }[strategy]


def model_args(a) -> list[str]:
    return [
        "--arch.hidden-size",
        str(a.hidden),
        "--arch.layers",
        str(a.layers),
        "--arch.heads",
        "4",
        "--arch.kv-heads",
        "2",
        "--arch.intermediate-size",
        str(a.hidden * 11 // 4),
        "--seq-length",
        "128",
        "--builtin-samples",
        "2000",
        "--warmup-steps",
        "2",
    ]


def parameters(a) -> int:
    from meshlm import config as config_mod
    from meshlm.models.build import build_model, load_tokenizer

    flags = model_args(a)
    cfg = config_mod.load(None, [(k.lstrip("-"), v) for k, v in zip(flags[::2], flags[1::2])])
    tokenizer, _ = load_tokenizer(cfg)
    return sum(p.numel() for p in build_model(cfg, tokenizer, "meta").parameters())


def run(a, strategy: str, ranks: int, extra: list[str] = ()) -> list[dict]:
    """One `meshlm train` job of global batch 16, a metrics row per step."""
    return train_rows(ranks, a.steps, 1, 16 // ranks, *model_args(a), "--strategy", strategy, *extra)


def tokens_per_s(rows: list[dict]) -> float:
    return statistics.median(r["tokens_per_s"] for r in rows[3:])  # skip warm-up steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    os.environ.setdefault("MESHLM_CACHE", tempfile.mkdtemp(prefix="meshlm-bench-cache-"))
    psi = parameters(a)
    n, shard = a.ranks, a.ranks // 2
    layouts = [
        ("ddp", []),
        ("zero1", []),
        ("zero2", []),
        ("zero3", []),
        ("hsdp", ["--parallel.shard-size", str(shard)]),
    ]
    print(f"model: {psi / 1e6:.2f}M parameters; {n} CPU ranks (gloo); global batch 16 x 128 tokens\n")
    print("| strategy | model_state_bytes / rank | formula | measured / formula | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for strategy, extra in layouts:
        rows = run(a, strategy, n, extra)
        measured, expected = rows[-1]["model_state_bytes"], formula(strategy, psi, n, shard)
        name = f"hsdp (K={shard})" if strategy == "hsdp" else strategy
        print(
            f"| {name} | {measured:,} | {expected:,.0f} | {measured / expected:.3f} | {tokens_per_s(rows):,.0f} |",
            flush=True,
        )
    ddp, zero3 = (tokens_per_s(run(a, s, 2)) for s in ("ddp", "zero3"))
    print(f"\n2 ranks: ddp {ddp:,.0f} tokens/s, zero3 {zero3:,.0f} tokens/s, zero3 / ddp = {zero3 / ddp:.2f}")


if __name__ == "__main__":
    main()
