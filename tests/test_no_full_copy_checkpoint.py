"""`meshlm generate --checkpoint` under tp reads only each rank's shards of a meshlm training checkpoint.

A 45M-parameter Llama (180 MB in fp32, tensors of at most 8 MB) trained one step by `meshlm train`
writes a DCP checkpoint; `generate --checkpoint RUN --mode tp --nproc 2` must keep every rank's peak RSS
minus the fixed cost (the same command on a tiny model) under 0.75 of the full model. Measured: 0.56 per
rank (half the model, plus DCP reading one saved tensor whole before narrowing it to the shard). Loading
the whole checkpoint on every rank before sharding it (as meshlm did before) measured 1.0. The pipeline
path (each stage reads its own tensors) is covered for tokens by tests/test_generate.py.
"""

from __future__ import annotations

import pytest

from conftest import generate_peaks, one_prompt, run_meshlm

pytestmark = pytest.mark.slow


def test_tp_ranks_read_only_their_shards_of_a_checkpoint(llama_45m, tiny_generate_peak, tmp_path):
    big_dir, _, big = llama_45m
    run = tmp_path / "run"
    train = ["--builtin-samples", "16", "--seq-length", "32", "--micro-batch-size", "1", "--max-steps", "1"]
    run_meshlm("train", "--model-name", big_dir, "--pretrained", *train, "--output-dir", run)
    prompts = one_prompt(tmp_path / "prompts.jsonl")
    for rank, peak in enumerate(generate_peaks(["--checkpoint", run], prompts, tmp_path / "big.jsonl", "tp")):
        share = (peak - tiny_generate_peak) / big
        print(
            f"tp rank {rank}: peak {peak / 2**20:.0f} MiB, fixed {tiny_generate_peak / 2**20:.0f} MiB, "
            f"{share:.2f} of full"
        )
        assert share < 0.75, f"tp rank {rank}: {share:.2f} of the full model above the fixed cost"
