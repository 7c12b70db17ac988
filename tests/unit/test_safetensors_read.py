"""Per-shard reads from safetensors: slices, sharded indexes and the one-line errors for bad checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from meshlm.errors import MeshlmError
from meshlm.models import safetensors_read
from meshlm.models.materialize import InitialWeights, _copy_rows, check_checkpoint, materialize, named_tensors
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


def _blocks_of_ten_rows(monkeypatch, ckpt, width: int) -> list[int]:
    """BLOCK_BYTES set to ten float32 rows of `width`; returns the row counts of every read that follows."""
    monkeypatch.setattr(safetensors_read, "BLOCK_BYTES", 10 * width * 4)
    rows, read = [], ckpt.read
    monkeypatch.setattr(
        ckpt, "read", lambda key, index: rows.append(index[0].stop - index[0].start) or read(key, index)
    )
    return rows


def test_read_into_maps_one_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """A mapped page counts in resident memory while mapped: read_into never maps more than BLOCK_BYTES of rows,
    and gives exactly the slice, for row and column slices, float32 and bfloat16 files, into either dtype."""
    torch.manual_seed(0)
    w = torch.randn(100, 24)
    save_file({"w": w, "b": w.to(torch.bfloat16)}, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    rows = _blocks_of_ten_rows(monkeypatch, ckpt, 24)
    for key, dtype in (("w", torch.float32), ("b", torch.float32), ("w", torch.bfloat16)):
        for index in ((slice(0, 100), slice(0, 24)), (slice(35, 97), slice(8, 20))):
            out = torch.empty(index[0].stop - index[0].start, index[1].stop - index[1].start, dtype=dtype)
            ckpt.read_into(key, index, out)
            want = (w if key == "w" else w.to(torch.bfloat16).float())[index].to(dtype)
            assert torch.equal(out, want), (key, dtype, index)
    assert max(rows) == 10 and sum(rows) == 3 * (100 + 62)


def test_pretrained_weights_are_read_one_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """--pretrained's reads, through transformers' conversion mapping (which leaves a Llama's tensors as stored):
    no read maps more than BLOCK_BYTES of a tensor's rows, the embedding and LM head included (reading either
    whole held it twice at a pipeline stage's peak), and every tensor is the checkpoint's."""
    torch.manual_seed(0)
    ref = tiny()
    ref.save_pretrained(tmp_path)
    monkeypatch.setattr(safetensors_read, "BLOCK_BYTES", 10 * 16 * 4)  # ten rows of the hidden width
    mapped, read = [], SafetensorsCheckpoint.read

    def counted(self, key, index):
        mapped.append(read(self, key, index))
        return mapped[-1]

    monkeypatch.setattr(SafetensorsCheckpoint, "read", counted)
    model = tiny("meta")
    materialize(model, InitialWeights.of(model, 0), "cpu", str(tmp_path))
    for name, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert sum(t.numel() for t in mapped) == sum(t.numel() for t in ref.parameters())
    assert max(t.nbytes for t in mapped) == safetensors_read.BLOCK_BYTES  # not the 64 rows of the embedding


def test_rows_past_the_checkpoint_are_its_mean_on_every_shard(tmp_path, monkeypatch):
    """A vocabulary grown past the checkpoint's 64 rows (mean resizing), read by ranks whose rows lie below,
    across and above row 64, in blocks of ten rows."""
    torch.manual_seed(0)
    w = torch.randn(64, 16)
    save_file({"e": w}, tmp_path / "model.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path)
    _blocks_of_ten_rows(monkeypatch, ckpt, 16)
    grown = torch.cat([w, (w.sum(0) / 64).expand(6, 16)])
    for a, b in ((0, 35), (35, 70), (66, 70)):
        out = torch.empty(b - a, 8)
        _copy_rows(ckpt, "e", (slice(a, b), slice(8, 16)), out)
        assert torch.equal(out, grown[a:b, 8:]), (a, b)


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
