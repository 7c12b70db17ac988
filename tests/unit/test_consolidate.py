"""Consolidation into sharded safetensors, one tensor at a time, with a tied head kept tied."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from meshlm.checkpoint.consolidate import tensors_to_write, write_safetensors


def test_tied_gpt2_into_several_shards_loads_tied(tmp_path):
    cfg = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step" / "state"), no_dist=True)
    with torch.device("meta"):
        skeleton = GPT2LMHeadModel(cfg)
    assert "lm_head.weight" not in tensors_to_write(skeleton) and "transformer.wte.weight" in tensors_to_write(skeleton)
    out = tmp_path / "out"
    out.mkdir()
    write_safetensors(skeleton, tmp_path / "step", out, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3 and not list(out.glob("part-*"))
    cfg.save_pretrained(out)
    back, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert back.lm_head.weight is back.transformer.wte.weight
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
