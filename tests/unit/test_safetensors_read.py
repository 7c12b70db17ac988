"""Per-shard reads from safetensors: slices, sharded indexes and the one-line errors for bad checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from meshlm.errors import MeshlmError
from meshlm.models.materialize import InitialWeights, check_checkpoint, materialize, named_tensors
from meshlm.models.safetensors_read import SafetensorsCheckpoint


def tiny(device="cpu", intermediate_size=32):
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=intermediate_size,
        max_position_embeddings=32,
    )
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def test_slices_come_from_every_shard_of_an_index(tmp_path):
    torch.manual_seed(0)
    tiny().save_pretrained(tmp_path, max_shard_size="8KB")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert len(set(ckpt.weight_map.values())) > 2
    ref = LlamaForCausalLM.from_pretrained(tmp_path)
    w = ref.model.layers[1].mlp.down_proj.weight
    assert torch.equal(ckpt.read("model.layers.1.mlp.down_proj.weight", (slice(4, 8), slice(16, 32))), w[4:8, 16:])


def test_materialize_loads_the_checkpoint_and_recomputes_rotary(tmp_path):
    torch.manual_seed(0)
    ref = tiny()
    ref.save_pretrained(tmp_path)
    model = tiny("meta")
    materialize(model, InitialWeights.of(model, 0), "cpu", str(tmp_path))
    for name, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)


def test_seeded_init_depends_on_name_and_seed_only():
    a, b = tiny("meta"), tiny("meta")
    materialize(a, InitialWeights.of(a, 7), "cpu")
    materialize(b, InitialWeights.of(b, 7), "cpu")
    for (n, x), (_, y) in zip(named_tensors(a), named_tensors(b)):
        assert torch.equal(x, y), n
    q, k = a.model.layers[0].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(q[:8], k[:8])  # different names, different draws
    # normal(0.02), ones
    assert 0.015 < float(q.detach().std()) < 0.025 and torch.equal(a.model.norm.weight, torch.ones(16))


def test_bin_only_directory_says_how_to_convert(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(MeshlmError, match=r"pytorch_model.bin: convert it with .*save_pretrained"):
        SafetensorsCheckpoint(tmp_path)


def test_index_naming_a_missing_file(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "one.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "one.safetensors", "lm_head.weight": "two.safetensors"}})
    )
    with pytest.raises(MeshlmError, match="names two.safetensors for tensor lm_head.weight, but that file is missing"):
        SafetensorsCheckpoint(tmp_path)


def test_shape_mismatch_and_missing_tensor_name_file_and_tensor(tmp_path):
    tiny().save_pretrained(tmp_path)
    model = tiny("meta", intermediate_size=48)
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(
        MeshlmError,
        match=r"model.layers.0.mlp.gate_proj.weight in .*model.safetensors has shape "
        r"\[32, 16\], but the model config needs \[48, 16\]",
    ):
        check_checkpoint(ckpt, model, list(named_tensors(model)))
    state = {k: v for k, v in LlamaForCausalLM.from_pretrained(tmp_path).state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    model = tiny("meta")
    with pytest.raises(MeshlmError, match="tensor lm_head.weight is missing from the checkpoint"):
        check_checkpoint(SafetensorsCheckpoint(tmp_path), model, list(named_tensors(model)))
