"""Attention kernels on the same packed blocks: forward + backward of the whole model per micro-batch (issue 23).

    python benchmarks/attention.py [--seq-length 128] [--micro-batch 8] [--repeats 3] [--steps 8]
        [--model-name DIR --dataset-name FILE] [--kernels sdpa,causal,meshlm_varlen] [--alone]

Rows: `sdpa` is transformers' dense block-diagonal mask from the packed position ids (meshlm's path
before --attention); `causal` is plain causal SDPA over the same blocks (the classic recipe: documents
see the ones before them, so not exact; the speed to match); `meshlm_varlen` is causal SDPA per document
(--attention varlen on CPU, auto's CPU choice from --seq-length 512); `flex_attention` (GPU only: no backward on
CPU) is transformers' FlexAttention path with one BlockMask per forward (--attention flex). One thread, CPU time
per step (process time: other load on the machine does not count); the kernels take turns within each repeat;
the best repeat's median step counts. Also prints the attention scores documents need against plain causal's.
--alone: attention alone instead of the model (forward + backward of one layer's attention, the model's heads and
head size, random queries, keys and values over the same packed blocks; each kernel's per-call set-up counted:
the dense mask from the position ids, meshlm_varlen's plan).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from meshlm.config import Config
from meshlm.data.load import load_blocks
from meshlm.models import attention
from meshlm.models.build import load_tokenizer, model_config


def batches(cfg: Config, micro: int, steps: int):
    tok, tok_id = load_tokenizer(cfg)
    blocks = load_blocks(cfg, tok, tok_id)
    return [blocks.batch(list(range(i * micro, (i + 1) * micro))) for i in range(steps)], len(tok)


def step_ms(model, kernel: str, data) -> float:
    model.set_attn_implementation(kernel if kernel != "causal" else "sdpa")
    times = []
    for b in data:
        pos = b.positions.long() if kernel != "causal" else None
        t = time.process_time()
        out = model(input_ids=b.ids.long(), position_ids=pos, labels=b.labels.long())
        out.loss.backward()
        times.append(time.process_time() - t)
        model.zero_grad(set_to_none=True)
    return statistics.median(times) * 1e3


def alone_ms(kernel: str, data, heads: int, dim: int) -> float:
    """Forward + backward of attention alone over each micro-batch's packed blocks (median CPU ms)."""
    times = []
    for b in data:
        pos = b.positions.long()
        n, s = pos.shape
        q, k, v = (torch.randn(n, s, heads, dim).transpose(1, 2).requires_grad_() for _ in range(3))
        t = time.process_time()
        if kernel == "meshlm_varlen":
            out = attention.Plan(pos).run(q, k, v, 0.0, None)
        else:
            doc = (pos != torch.cat([pos[:, :1] - 1, pos[:, :-1]], 1) + 1).cumsum(1)
            mask = (doc[:, :, None] == doc[:, None, :]).tril()[:, None] if kernel == "sdpa" else None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None).transpose(1, 2)
        out.sum().backward()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def pairs(data) -> tuple[int, int]:
    """Score pairs (query, key) a document-aware kernel needs, and plain causal attention's."""
    docs = sum(n * (n + 1) // 2 for b in data for row in attention.document_lengths(b.positions) for n in row)
    seq = data[0].positions.shape[1]
    return docs, sum(b.positions.shape[0] for b in data) * seq * (seq + 1) // 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-name", default="")
    ap.add_argument("--dataset-name", default="")
    ap.add_argument("--kernels", default="sdpa,causal,meshlm_varlen")  # + flex_attention on a GPU
    ap.add_argument("--alone", action="store_true", help="attention alone, not the model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = Config(seq_length=args.seq_length, model_name=args.model_name, dataset_name=args.dataset_name)
    data, vocab = batches(cfg, args.micro_batch, args.steps + 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(cfg, vocab), attn_implementation="sdpa")
    kernels = args.kernels.split(",")
    c = model.config
    heads, dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    timed = partial(alone_ms, heads=heads, dim=dim) if args.alone else partial(step_ms, model)
    for k in kernels:
        timed(k, data[:2])  # warm-up (flex compiles here)
    best = {k: float("inf") for k in kernels}
    for r in range(args.repeats):
        for k in kernels if r % 2 == 0 else kernels[::-1]:
            best[k] = min(best[k], timed(k, data[2:]))
    docs, causal = pairs(data[2:])
    what = f"attention alone ({heads} heads x {dim})" if args.alone else "the model's forward + backward"
    print(f"{what}; seq {args.seq_length}, micro-batch {args.micro_batch}, {args.steps} steps, best of {args.repeats}")
    print(f"score pairs: documents {docs:,}, plain causal {causal:,} ({docs / causal:.2f})")
    print(f"{'kernel':<16}{'ms/step':>9}{'vs causal':>11}")
    for k in kernels:
        print(f"{k:<16}{best[k]:>9.1f}{best['causal'] / best[k] if 'causal' in best else 0:>10.2f}x")


if __name__ == "__main__":
    main()
