"""How close `meshlm plan`'s activation model is to what transformers' modules really hold, over a grid.

For Llama (RMSNorm, SwiGLU, rotary, GQA) and GPT-2 (LayerNorm, GELU), fused (SDPA) and eager attention,
the three precision set-ups meshlm runs (fp32; bf16 autocast over fp32 weights as in single/ddp/zero1;
bf16 weights as FSDP2 mixed precision computes) and with/without full activation checkpointing, one real
training step of a small model is tracked with torch.distributed._tools.MemTracker (the probe `meshlm plan
--validate` uses) and its activation peak is compared with the prediction. Prints a table; the planner's
target is 20%.

    PYTHONPATH=src python benchmarks/plan_accuracy.py [--quick]
"""

from __future__ import annotations

import contextlib
import itertools
import sys

import torch
from transformers import AutoModelForCausalLM

from meshlm.plan.job import Job
from meshlm.plan.memory import memory
from meshlm.plan.shape import StageShape
from meshlm.plan.spec import from_hf_config, hf_config_from_dims
from meshlm.train.probe import _memory_tracker

# (hidden, layers, heads, kv heads, mlp, vocab, seq, batch): logits-heavy, MLP-heavy, many heads
DIMS = [(64, 2, 4, 2, 128, 320, 64, 8), (256, 2, 4, 2, 1024, 64, 64, 8), (128, 3, 8, 8, 256, 512, 32, 4)]
MODES = {"fp32": ("fp32", False), "bf16 autocast": ("bf16", False), "bf16 FSDP weights": ("bf16", True)}


def measure(family, attention, mode, ac, dims) -> tuple[int, int]:
    h, layers, heads, kv, mlp, vocab, seq, batch = dims
    precision, bf16_weights = MODES[mode]
    c = hf_config_from_dims(family, layers, h, heads, kv if family == "llama" else heads, mlp, vocab, 1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        c, dtype=torch.float32, attn_implementation="sdpa" if attention == "fused" else "eager"
    )
    if ac:
        from meshlm.compat import checkpoint_wrapper

        blocks = model.model.layers if family == "llama" else model.transformer.h
        for i in range(layers):
            blocks[i] = checkpoint_wrapper(blocks[i])
    if bf16_weights:
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq))
    opt = torch.optim.AdamW(model.parameters())
    cast = (lambda: torch.autocast("cpu", torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    tracker = None
    for step in range(2):
        ctx = tracker = _memory_tracker(model, opt) if step else contextlib.nullcontext()
        with ctx:
            with cast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
    spec = from_hf_config("bench", c)
    job = Job(seq_length=seq, micro_batch=batch, precision=precision, attention=attention)
    strategy = "zero3" if bf16_weights else "single"
    predicted = memory(spec, job, StageShape(layers, True, True, 1, 1), strategy, 1, 1, batch, ac, False).act.peak
    return predicted, tracker.step_peak()[0]


def main() -> None:
    quick = "--quick" in sys.argv
    grid = itertools.product(["llama", "gpt2"], ["fused", "eager"], MODES, [False, True], DIMS[:1] if quick else DIMS)
    print(
        f"{'family':<6} {'attention':<9} {'precision':<18} {'ckpt':<4} {'dims (h,L,a,kv,mlp,V,s,b)':<32} "
        f"{'predicted':>11} {'measured':>11} {'ratio':>6}"
    )
    worst = 1.0
    for family, attention, mode, ac, dims in grid:
        predicted, measured = measure(family, attention, mode, ac, dims)
        ratio = predicted / measured
        worst = max(worst, abs(ratio - 1) + 1)
        print(
            f"{family:<6} {attention:<9} {mode:<18} {'yes' if ac else 'no':<4} {str(dims):<32} "
            f"{predicted:>11,} {measured:>11,} {ratio:>6.3f}"
        )
    print(f"largest deviation: {worst - 1:.1%} (target 20%)")


if __name__ == "__main__":
    main()
