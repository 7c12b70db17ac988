"""`--measure-step` on a model with frozen parameters (LoRA's base, DPO's reference): torch's memory tracker hooks
every parameter's gradient, and a frozen parameter refuses a hook (RuntimeError at the first forward)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshlm.train.probe import _memory_tracker


def test_the_step_probe_measures_a_model_with_frozen_parameters():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.model.requires_grad_(False)  # a frozen base; the head trains
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, 64, (2, 16))
    with _memory_tracker(model, opt) as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    peak, kept = tracker.step_peak()
    assert peak > 0
    assert all(p.grad is None for p in model.model.parameters())
