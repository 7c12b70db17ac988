"""No rank of a split layout ever holds the whole model: each rank's peak resident memory stays near its shard.

`meshlm generate` (no gradients or optimizer state to hide a transient copy behind) on a 45M-parameter Llama
(180 MB in fp32, tensors of at most 8 MB) under tp 2 and pp 2: every rank's peak RSS minus the fixed cost of
the same job with a tiny model must be under 0.6 of the full model. The rank's own half is 0.5 (measured:
tp 0.51, pp 0.41 with pretrained slices read in 16 MiB blocks); building the whole model first (as meshlm
did before the meta-device flow) costs at least 1.0 + 0.5. Peak RSS is what the kernel counted for the
process, so it does not depend on how loaded the machine is.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import run_meshlm
from meshlm.data.builtin import byte_tokenizer

pytestmark = pytest.mark.slow


def _model(path, hidden: int, layers: int, mlp: int, vocab: int) -> int:
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=mlp,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    LlamaForCausalLM(cfg).save_pretrained(path)  # random weights: only the sizes matter here
    byte_tokenizer().save_pretrained(path)
    return 4 * n


def _peaks(model, prompts, mode) -> list[int]:
    out = model.parent / f"{model.name}-{mode}.jsonl"
    run_meshlm(
        "generate",
        "--model-name",
        model,
        "--prompts",
        prompts,
        "--out",
        out,
        "--max-new-tokens",
        "2",
        "--mode",
        mode,
        "--nproc",
        "2",
    )
    summary = out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")
    return [r["mem_peak_bytes"] for r in json.loads(summary.read_text())["per_rank"]]


def test_tp_and_pp_ranks_hold_their_part_only(tmp_path):
    big = _model(tmp_path / "big", hidden=512, layers=12, mlp=1536, vocab=4096)
    _model(tmp_path / "tiny", hidden=64, layers=2, mlp=128, vocab=320)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 2 3"}) + "\n")
    fixed = max(_peaks(tmp_path / "tiny", prompts, "tp"))
    for mode in ("tp", "pp"):
        for rank, peak in enumerate(_peaks(tmp_path / "big", prompts, mode)):
            share = (peak - fixed) / big
            print(
                f"{mode} rank {rank}: peak {peak / 2**20:.0f} MiB, fixed {fixed / 2**20:.0f} MiB, {share:.2f} of full"
            )
            assert share < 0.6, f"{mode} rank {rank}: {share:.2f} of the full model above the fixed cost"
