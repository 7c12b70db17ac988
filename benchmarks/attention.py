"""Attention kernels on the same packed blocks: forward + backward of the whole model per micro-batch.

    python benchmarks/attention.py [--seq-length 128] [--micro-batch 8] [--repeats 3] [--steps 8]
        [--model-name DIR --dataset-name FILE] [--kernels sdpa,causal,meshlm_sdpa,meshlm_varlen] [--alone]

Rows: `sdpa` is transformers' SDPA path with the dense block-diagonal mask from the packed position ids (meshlm's
path before --attention; transformers repeats the key/value heads whenever there is a mask); `causal` is plain
causal SDPA over the same blocks (the classic recipe: documents see the ones before them, so not exact; the speed
to match); `meshlm_sdpa` is one SDPA call with meshlm's additive document mask, key/value heads shared in the
kernel (auto's CPU choice below --seq-length 512); `meshlm_varlen` is causal SDPA per run of documents
(--attention varlen on CPU, auto's choice from 512); `flex_attention` (GPU only: no backward on CPU) is
transformers' FlexAttention path with one BlockMask per forward (--attention flex). The model is built without a
KV cache, as training builds it (with one, transformers ignores the packed positions and `sdpa` is plain causal).
One thread, CPU time per micro-batch (process time: other load on the machine counts less); in each repeat every
kernel runs each micro-batch in turn (the first one rotating), the best repeat's median counts; `paired` is the
median over micro-batches and repeats of causal's time / the kernel's on the same micro-batch in the same turn.
Also prints the attention scores documents need against plain causal's.
--alone: attention alone instead of the model (forward + backward of one layer's attention, the model's heads and
head size, random queries, keys and values over the same packed blocks; each kernel's per-call set-up counted:
the dense mask from the position ids, meshlm's mask or plan).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv

from meshlm.config import Config
from meshlm.data.load import load_data
from meshlm.models import attention
from meshlm.models.build import load_tokenizer, model_config


def batches(cfg: Config, micro: int, steps: int):
    tok, tok_id = load_tokenizer(cfg)
    blocks = load_data(cfg, tok, tok_id)[0]
    return [blocks.batch(list(range(i * micro, (i + 1) * micro))) for i in range(steps)], len(tok)


def step_s(model, kernel: str, b) -> float:
    """CPU seconds of the model's forward + backward on micro-batch `b`."""
    model.set_attn_implementation(kernel if kernel != "causal" else "sdpa")
    pos = b.positions.long() if kernel != "causal" else None
    t = time.process_time()
    out = model(input_ids=b.ids.long(), position_ids=pos, labels=b.labels.long())
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - t


def alone_s(kernel: str, b, heads: int, kv_heads: int, dim: int) -> float:
    """CPU seconds of attention alone (forward + backward) over micro-batch `b`'s packed blocks."""
    pos = b.positions.long()
    n, s = pos.shape
    q, k, v = (torch.randn(n, s, x, dim).transpose(1, 2).requires_grad_() for x in (heads, kv_heads, kv_heads))
    t = time.process_time()
    if kernel == attention.DOCUMENTS:
        out = attention.Plan(pos, n).run(q, k, v, 0.0, None)
    elif kernel == "causal":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads).transpose(1, 2)
    else:  # the dense mask, as transformers' sdpa_mask makes it
        doc = (pos != torch.cat([pos[:, :1] - 1, pos[:, :-1]], 1) + 1).cumsum(1)
        mask = (doc[:, :, None] == doc[:, None, :]).tril()[:, None]
        if kernel == attention.MASKED:  # additive, the key/value heads shared in the kernel
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention.additive(mask, q.dtype), enable_gqa=True)
        else:  # transformers' SDPA path: the key/value heads repeated where there is a mask
            k, v = (repeat_kv(x, heads // kv_heads) for x in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2)
    out.sum().backward()
    return time.process_time() - t


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
    ap.add_argument("--kernels", default="sdpa,causal,meshlm_sdpa,meshlm_varlen")  # + flex_attention on a GPU
    ap.add_argument("--alone", action="store_true", help="attention alone, not the model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = Config(seq_length=args.seq_length, model_name=args.model_name, dataset_name=args.dataset_name)
    data, vocab = batches(cfg, args.micro_batch, args.steps + 1)
    torch.manual_seed(0)
    mcfg = model_config(cfg, vocab)
    mcfg.use_cache = False  # as training builds it: with a cache transformers ignores the packed positions
    model = AutoModelForCausalLM.from_config(mcfg, attn_implementation="sdpa")
    kernels = args.kernels.split(",")
    heads, kv_heads = mcfg.num_attention_heads, mcfg.num_key_value_heads
    dim = mcfg.hidden_size // heads
    timed = partial(alone_s, heads=heads, kv_heads=kv_heads, dim=dim) if args.alone else partial(step_s, model)
    for k in kernels:
        timed(k, data[0])  # warm-up (flex compiles here)
    times = {k: [[] for _ in range(args.repeats)] for k in kernels}
    for r in range(args.repeats):
        for i, b in enumerate(data[1:]):  # every kernel on the same micro-batch in turn, the first one rotating
            turn = (r + i) % len(kernels)
            for k in kernels[turn:] + kernels[:turn]:
                times[k][r].append(timed(k, b))
    best = {k: min(statistics.median(t) for t in times[k]) * 1e3 for k in kernels}
    docs, causal = pairs(data[1:])
    what = f"attention alone ({heads} / {kv_heads} heads x {dim})" if args.alone else "the model's forward + backward"
    print(f"{what}; seq {args.seq_length}, micro-batch {args.micro_batch}, {args.steps} steps, best of {args.repeats}")
    print(f"score pairs: documents {docs:,}, plain causal {causal:,} ({docs / causal:.2f})")
    print(f"{'kernel':<16}{'ms/step':>9}{'vs causal':>11}{'paired':>9}")
    for k in kernels:
        ratio = best["causal"] / best[k] if "causal" in best else 0
        paired = statistics.median(c / t for c, t in zip(sum(times.get("causal", times[k]), []), sum(times[k], [])))
        print(f"{k:<16}{best[k]:>9.1f}{ratio:>10.3f}x{paired:>8.3f}x")


if __name__ == "__main__":
    main()
