"""--float8: which Linear layers torchao's Float8Linear replaces, the model still trains with torch's CPU float8
matmul (torch._scaled_mm runs on CPU in torch 2.13: the same casts and scales as on a GPU), torchao's float8 TP
styles for tensorwise layers, and the refusals. The layouts (tp, pp, FSDP) run in tests/test_model_parallel.py;
the float8 kernels' speed needs a GPU of compute capability 8.9+ (make gpu-check)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from meshlm import compat
from meshlm.errors import MeshlmError
from meshlm.parallel import float8

pytest.importorskip("torchao")


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg.__class__(**{**cfg.to_dict(), "intermediate_size": 128}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_layers_train_close_to_fp32(recipe):
    if recipe == "rowwise" and not compat.cpu_rowwise_float8():
        pytest.skip("this torch's CPU float8 matmul has no row-wise scales (float8.refusal says so)")
    model, ref = _llama(), _llama()
    assert float8.convert(model, recipe, fsdp=False) == 2 * 7  # q k v o gate up down per block
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
    # under tensor parallel each rank's shard must be a multiple of 16: 64 / 2 is 32, 64 / 8 is 8
    assert float8.converts(nn.Linear(64, 128), "model.layers.0.mlp.up_proj", tp=2)
    assert not float8.converts(nn.Linear(64, 128), "model.layers.0.mlp.up_proj", tp=8)


def test_tensorwise_layers_take_torchaos_float8_tp_styles():
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    plan = float8.tp_styles(
        {"a": ColwiseParallel(), "b": RowwiseParallel(output_layouts=torch.distributed.tensor.Shard(1)), "c": None}
    )
    assert plan["c"] is None
    col, row = plan["a"], plan["b"]
    assert type(col.float8) is Float8ColwiseParallel and type(row.float8) is Float8RowwiseParallel
    assert row.float8.output_layouts == row.plain.output_layouts  # the same split as torch's style
    tensorwise, rowwise = _llama(), _llama()
    float8.convert(tensorwise, "tensorwise", fsdp=False)
    float8.convert(rowwise, "rowwise", fsdp=False)
    assert float8.tensorwise(tensorwise.model.layers[0].mlp.up_proj)
    assert not float8.tensorwise(rowwise.model.layers[0].mlp.up_proj)  # rowwise: torch's styles (as torchtitan)
    assert not float8.tensorwise(tensorwise.lm_head)


def test_refusals(monkeypatch):
    cpu = torch.device("cpu")
    assert float8.refusal("off", cpu) == "" and float8.refusal("tensorwise", cpu) == ""
    assert (float8.refusal("rowwise", cpu) == "") == compat.cpu_rowwise_float8()
    monkeypatch.setattr(compat, "cpu_rowwise_float8", lambda: False)
    assert float8.refusal("rowwise", cpu).startswith("--float8 rowwise on CPU ranks needs torch 2.13 or newer")
    monkeypatch.undo()
    assert float8.refusal("rowwise", cpu, sequence_parallel=True) == float8.refusal("rowwise", cpu)
    with pytest.raises(MeshlmError, match="tensorwise with --parallel.sequence-parallel all-gathers float8 tensors"):
        float8.check("tensorwise", cpu, sequence_parallel=True)
    with pytest.raises(MeshlmError, match="gpt2's projections are transformers' Conv1D: drop --float8"):
        float8.check_model("rowwise", GPT2Config())
    float8.check_model("off", GPT2Config())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert float8.refusal("tensorwise", cpu) == "--float8 tensorwise needs torchao: pip install 'meshlm[float8]'"
