"""--float8: which Linear layers torchao's Float8Linear replaces, the model still trains (torchao's emulated
float8 matmuls on CPU: the same casts and scales), and the refusal on CPU ranks. The float8 kernels themselves
and their speed need a GPU of compute capability 8.9+ (make gpu-check)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from meshlm.errors import MeshlmError
from meshlm.parallel import float8

pytest.importorskip("torchao")


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg.__class__(**{**cfg.to_dict(), "intermediate_size": 128}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_layers_train_close_to_fp32(recipe):
    model, ref = _llama(), _llama()
    assert float8.convert(model, recipe, fsdp=False, emulate=True) == 2 * 7  # q k v o gate up down per block
    assert type(model.lm_head) is nn.Linear  # the head keeps its precision
    assert all(type(m) is not nn.Linear for n, m in model.named_modules() if ".layers." in n and "proj" in n)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, ref_loss = (m(input_ids=ids, labels=ids).loss for m in (model, ref))
    loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-2 * ref_loss.item()  # e4m3: 3 mantissa bits
    g, r = model.model.layers[0].mlp.up_proj.weight.grad, ref.model.layers[0].mlp.up_proj.weight.grad
    assert 0 < (g - r).norm() / r.norm() < 0.25  # float8's error, not zero (the casts did happen), not noise


def test_dimensions_not_multiples_of_16_stay():
    assert float8.converts(nn.Linear(64, 128), "model.layers.0.mlp.up_proj")
    assert not float8.converts(nn.Linear(64, 100), "model.layers.0.mlp.up_proj")
    assert not float8.converts(nn.Linear(64, 128), "lm_head")


def test_refused_on_cpu():
    assert float8.refusal("off", torch.device("cpu"), 1, 1) == ""
    with pytest.raises(MeshlmError, match="--float8 tensorwise needs a CUDA GPU with compute capability 8.9"):
        float8.check("tensorwise", torch.device("cpu"), 1, 1)
