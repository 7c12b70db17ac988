"""`meshlm plan --simulate`: llama-7b under zero3 on 8 GPUs, run by meshlm's own code on fake tensors over a fake
process group (ranks 0 and 7), against the analytic plan: model states within 2%, the step's activations and
buffers within 15%, the peak within 15%. No memory of the model's size is allocated (the run would need about
100 GiB otherwise)."""

from __future__ import annotations

import json

import pytest

from conftest import run_meshlm

pytestmark = pytest.mark.slow


def test_simulated_llama_7b_zero3_agrees_with_the_plan():
    p = run_meshlm(
        "plan",
        "--model",
        "llama-7b",
        "--gpus-per-node",
        "8",
        "--strategy",
        "zero3",
        "--tp",
        "1",
        "--pp",
        "1",
        "--activation-checkpointing",
        "none",
        "--simulate",
        "--json",
    )
    data = json.loads(p.stdout)
    ranks = {r["rank"]: r for r in data["simulated"]}
    assert set(ranks) == {0, 7}
    for r in ranks.values():
        assert r["model_states"] == pytest.approx(r["plan"]["model_states"], rel=0.02)
        assert r["activations_and_buffers"] == pytest.approx(r["plan"]["activations_and_buffers"], rel=0.15)
        assert r["peak"] == pytest.approx(r["plan"]["peak"], rel=0.15)
        # zero3 shards the fp32 parameters and gradients over the 8 ranks: an eighth of Llama-2-7B each
        assert r["parameters"] == r["gradients"] == pytest.approx(6_738_415_616 * 4 / 8, rel=0.001)
