"""`meshlm export` of a tied GPT-2 (a local directory, as the seed recipe uses) trained under single, zero3 and
tp: the export loads in transformers with the embedding and LM head still one tensor, and computes the trained
model's logits (the trained weights gathered by torch's own DCP converter, not by meshlm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from conftest import meshlm_here, run_cases, run_meshlm
from meshlm.data.builtin import byte_tokenizer

pytestmark = pytest.mark.slow

ARGS = [
    "--seq-length",
    "32",
    "--builtin-samples",
    "64",
    "--max-steps",
    "2",
    "--micro-batch-size",
    "4",
    "--progress",
    "false",
]
LAYOUTS = {  # the 2-rank ones in one launch (conftest.run_cases: one process start-up for both)
    "single": [],
    "zero3": ["--strategy", "zero3", "--micro-batch-size", "2"],
    "tp": ["--parallel.tp", "2"],
}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    tok = byte_tokenizer()
    cfg = GPT2Config(
        vocab_size=(len(tok) + 63) // 64 * 64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def runs(gpt2_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tied-runs")
    run_meshlm("train", *ARGS, "--model-name", gpt2_dir, "--pretrained", "--output-dir", root / "single")
    cases = [
        {"id": name, "kind": "train", "args": [*ARGS, *LAYOUTS[name], "--model-name", str(gpt2_dir), "--pretrained",
                                                "true", "--output-dir", str(root / name)]}
        for name in ("zero3", "tp")
    ]  # fmt: skip
    run_cases(2, cases, root / "launch")
    return root


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_keeps_the_tie_and_the_trained_weights(runs, gpt2_dir, tmp_path, layout):
    run = runs / layout
    meshlm_here("export", "--checkpoint", run, "--out", tmp_path / "hf")
    exported, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert exported.lm_head.weight is exported.transformer.wte.weight

    dcp_to_torch_save(run / "checkpoints" / "step-2" / "state", tmp_path / "full.pt")
    trained = AutoModelForCausalLM.from_pretrained(gpt2_dir)
    trained.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=False)["model"])
    before = AutoModelForCausalLM.from_pretrained(gpt2_dir)
    ids = torch.tensor([[3, 70, 71, 72, 40, 9]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
        assert not torch.allclose(exported(ids).logits, before(ids).logits)  # it did train
