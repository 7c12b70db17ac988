"""The LM head and loss of an SFT job, three ways, in one process: the whole logits (transformers' head,
then meshlm's token loss), the fused loss head on every position, and the fused head on the positions with a
target only (parallel/loss.py `_target_rows`, what `--chunked-loss auto` runs where tokens >= hidden).

    python benchmarks/loss_head.py [--model-name DIR --dataset-name FILE] [--seq-length 128] [--micro-batch 8]

Without a model and data it builds the Alpaca job (vs_accelerate.py --job alpaca: a BPE tokenizer of 4,096,
a Llama of hidden 256 x 4 blocks, 3,000 records; loss on the responses, meshlm's default) in a temp dir. Forward +
backward of the whole model per micro-batch with meshlm_sdpa, one thread, CPU time; the three kinds take turns on
each micro-batch (the first rotating), the median over micro-batches and repeats counts. Also prints the share of
positions with a target and each kind's loss on one micro-batch (they must agree).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from attention import batches
from transformers import AutoModelForCausalLM
from vs_accelerate import alpaca_job

from meshlm.config import Config
from meshlm.data.batch import IGNORE
from meshlm.models import attention
from meshlm.models.build import model_config
from meshlm.parallel.loss import _FusedChunkedLoss, _target_rows, next_token_targets, targets_loss_sum

KINDS = ("whole logits", "fused, every position", "fused, targets only")


def step(model, kind: str, b) -> tuple[float, float]:
    """CPU seconds of forward + backward of micro-batch `b`, and its summed loss."""
    t = time.process_time()
    targets = next_token_targets(b.labels.long())
    ids, pos = b.ids.long(), b.positions.long()
    if kind == KINDS[0]:
        loss = targets_loss_sum(model(input_ids=ids, position_ids=pos, use_cache=False).logits, targets)
    else:
        h = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        h, tg = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        if kind == KINDS[2]:
            h, tg = _target_rows(h, tg)
        head = model.get_output_embeddings()
        loss = _FusedChunkedLoss.apply(h, head.weight, head.bias, tg, max(1, h.shape[0]))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - t, loss.item()


def run(args, model_name: str, dataset_name: str) -> None:
    torch.set_num_threads(1)
    cfg = Config(seq_length=args.seq_length, model_name=model_name, dataset_name=dataset_name)
    data, vocab = batches(cfg, args.micro_batch, args.steps + 1)
    mcfg = model_config(cfg, vocab)
    mcfg.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mcfg, attn_implementation=attention.MASKED)
    share = statistics.mean((next_token_targets(b.labels) != IGNORE).float().mean().item() for b in data)
    for k in KINDS:
        step(model, k, data[0])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.repeats):
        for i, b in enumerate(data[1:]):
            turn = (r + i) % len(KINDS)
            for k in KINDS[turn:] + KINDS[:turn]:
                times[k].append(step(model, k, b)[0])
    print(f"seq {args.seq_length} x micro-batch {args.micro_batch}, {args.steps} micro-batches x {args.repeats}")
    print(f"positions with a target: {share:.3f}")
    base = statistics.median(times[KINDS[0]])
    print(f"{'kind':<24}{'ms (median)':>12}{'vs whole':>10}{'loss (one micro-batch)':>24}")
    for k in KINDS:
        med = statistics.median(times[k])
        print(f"{k:<24}{med * 1e3:>12.1f}{med / base:>10.3f}{step(model, k, data[1])[1]:>24.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-name", default="")
    ap.add_argument("--dataset-name", default="")
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.model_name:
        run(args, args.model_name, args.dataset_name)
        return
    with tempfile.TemporaryDirectory() as root:
        job = alpaca_job(Path(root), 3000)
        run(args, job[1], job[3])


if __name__ == "__main__":
    main()
