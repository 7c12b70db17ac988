"""`meshlm generate --checkpoint` under tp reads only each rank's shards of a meshlm training checkpoint.

A 45M-parameter Llama (180 MB in fp32, tensors of at most 8 MB) trained one step by `meshlm train`
writes a DCP checkpoint; `generate --checkpoint RUN --mode tp --nproc 2` must keep every rank's peak RSS
minus the fixed cost (the same command on a tiny model) under 0.75 of the full model. Measured: 0.56 per
rank (half the model, plus DCP reading one saved tensor whole before narrowing it to the shard). Loading
the whole checkpoint on every rank before sharding it (as meshlm did before) measured 1.0. The pipeline
path (each stage reads its own tensors) is covered for tokens by tests/test_generate.py.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_meshlm, save_llama

pytestmark = pytest.mark.slow


def _peaks(source: list, prompts, out) -> list[int]:
    run_meshlm(
        "generate", *source, "--prompts", prompts, "--out", out, "--max-new-tokens", "2", "--mode", "tp", "--nproc", "2"
    )
    summary = out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")
    return [r["mem_peak_bytes"] for r in json.loads(summary.read_text())["per_rank"]]


def test_tp_ranks_read_only_their_shards_of_a_checkpoint(tmp_path):
    big = save_llama(tmp_path / "big", hidden=512, layers=12, mlp=1536, vocab=4096)
    save_llama(tmp_path / "tiny", hidden=64, layers=2, mlp=128, vocab=320)
    run = tmp_path / "run"
    train = ["--builtin-samples", "16", "--seq-length", "32", "--micro-batch-size", "1", "--max-steps", "1"]
    run_meshlm("train", "--model-name", tmp_path / "big", "--pretrained", *train, "--output-dir", run)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 2 3"}) + "\n")
    fixed = max(_peaks(["--model-name", tmp_path / "tiny"], prompts, tmp_path / "tiny.jsonl"))
    for rank, peak in enumerate(_peaks(["--checkpoint", run], prompts, tmp_path / "big.jsonl")):
        share = (peak - fixed) / big
        print(f"tp rank {rank}: peak {peak / 2**20:.0f} MiB, fixed {fixed / 2**20:.0f} MiB, {share:.2f} of full")
        assert share < 0.75, f"tp rank {rank}: {share:.2f} of the full model above the fixed cost"
