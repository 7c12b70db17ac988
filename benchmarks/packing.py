"""Packing with document masks against padded batches, and the document mask against plain causal attention.

    python benchmarks/packing.py [--records 3000] [--seq-length 1024] [--steps 8]

An Alpaca-like JSONL is generated with a realistic length spread (lognormal word counts: instructions
~12 words, inputs empty for 60% of records, outputs ~45 words with a long tail), tokenised byte-level
(meshlm's built-in tokenizer) into blocks by meshlm's own data path, loss on responses. The model is
`meshlm train`'s default (a Llama, hidden 128, 4 blocks), fp32, micro-batch 8, one thread, forward +
backward (the optimizer step is the same for every row and left out). Per row: the blocks the corpus
makes, their padding fraction and target tokens per block (over the whole corpus), the median milliseconds per
step of 8 blocks after 2 warm-up steps, block tokens/s, target tokens/s (what is learned) and the time for one
epoch.
Byte-level tokens make records ~4x longer than a BPE tokenizer would, hence blocks of 1024.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshlm import config as config_mod
from meshlm.data.builtin import byte_tokenizer
from meshlm.data.load import load_data
from meshlm.models.build import build_model
from meshlm.parallel.loss import token_loss_sum


def _words(rng: random.Random, mean_words: float, sigma: float, cap: int) -> str:
    n = min(cap, max(1, int(rng.lognormvariate(0, sigma) * mean_words)))
    return " ".join("".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 8))) for _ in range(n))


def alpaca_like(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            rec = {
                "instruction": _words(rng, 10, 0.5, 60),
                "input": _words(rng, 15, 0.8, 120) if rng.random() < 0.4 else "",
                "output": _words(rng, 35, 0.9, 400),
            }
            f.write(json.dumps(rec) + "\n")


def _step(model, b, masked: bool) -> float:
    t = time.perf_counter()
    kw = {"position_ids": b.positions} if masked else {}  # without: one causal sequence per block
    logits = model(input_ids=b.ids, use_cache=False, **kw).logits
    (token_loss_sum(logits, b.labels) / b.targets().clamp(min=1)).backward()
    model.zero_grad()
    return time.perf_counter() - t


def measure(cfg, blocks, steps: int, variants: tuple[bool, ...]) -> list[dict]:
    """Forward + backward of the first `steps` batches of 8 blocks, each variant (document mask or plain
    causal) on the same batch back to back, alternating which goes first: paired against the machine's
    load drifting."""
    torch.manual_seed(0)
    model = build_model(cfg, byte_tokenizer())
    times = {v: [] for v in variants}
    for step in range(steps + 2):
        b = blocks.batch(list(range(step * 8, step * 8 + 8))).to("cpu")
        order = variants if step % 2 else variants[::-1]
        for v in order:
            dt = _step(model, b, v)
            if step >= 2:  # warm-up
                times[v].append(dt)
    block_tokens = 8 * cfg.seq_length
    whole = blocks.batch(range(len(blocks)))  # the corpus's padding and targets, not only the measured batches'
    targets_per_block = int(whole.targets()) / len(blocks)
    out = []
    for v in variants:
        ms = statistics.median(times[v])
        out.append(
            {
                "masked": v,
                "ms": ms * 1e3,
                "pad": blocks.padding(),
                "targets_per_block": targets_per_block,
                "tok_s": block_tokens / ms,
                "target_tok_s": 8 * targets_per_block / ms,
                "epoch_s": len(blocks) / 8 * ms,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "alpaca_like.jsonl"
        alpaca_like(data, args.records)
        os.environ["MESHLM_CACHE"] = str(Path(tmp) / "cache")
        rows = []
        for packing, variants in ((True, (True, False)), (False, (True,))):
            cfg = config_mod.load(
                None,
                [("dataset_name", str(data)), ("seq_length", str(args.seq_length)), ("packing", str(packing).lower())],
            )
            blocks, _ = load_data(cfg, byte_tokenizer(), "builtin-bytes")
            for r in measure(cfg, blocks, args.steps, variants):
                name = ("packed" if packing else "padded, a record per block") + (
                    ", document mask" if r["masked"] and packing else ", plain causal" if packing else ""
                )
                rows.append((name, len(blocks), r))
    print(
        f"{'blocks of ' + str(args.seq_length):<36}{'blocks':>7}{'padding':>9}{'targets/blk':>12}{'ms/step':>9}"
        f"{'tok/s':>8}{'target tok/s':>13}{'epoch s':>9}"
    )
    for name, n, r in rows:
        print(
            f"{name:<36}{n:>7}{r['pad']:>9.1%}{r['targets_per_block']:>12.0f}{r['ms']:>9.0f}{r['tok_s']:>8.0f}"
            f"{r['target_tok_s']:>13.0f}{r['epoch_s']:>9.0f}"
        )


if __name__ == "__main__":
    main()
