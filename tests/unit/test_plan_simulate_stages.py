"""`plan --simulate` of a pipeline runs one rank per kind of stage (first, last, and each distinct run of
middle layers) and derives the others from the micro-batches they hold in flight. On a tiny Qwen3-MoE under
pp 4 x tp 2 (8 fake ranks; 1F1B holds 4, 3, 2, 1 micro-batches) the derived stage's numbers equal that stage's
own simulation byte for byte. The 235B preset's 32 stages: benchmarks/moe_plan.py --skip-table (minutes)."""

from __future__ import annotations

import pytest

from meshlm.cli import build_parser
from meshlm.plan import advisor
from meshlm.plan.cli import shown
from meshlm.plan.inputs import inputs

QUANTITIES = ("model_states", "parameters", "gradients", "optimizer", "activations_and_buffers", "peak", "startup")


@pytest.fixture(scope="module")
def pp4(tmp_path_factory):
    """(spec, job, estimate) of a 6-layer Qwen3-MoE (8 experts, 2 per token) planned as tp 2 x pp 4 with
    activation checkpointing on 8 GPUs (the 235B preset's winner is tp 2 x pp 32 so)."""
    from transformers import Qwen3MoeConfig

    path = tmp_path_factory.mktemp("qwen3-moe")
    Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    ).save_pretrained(path)
    argv = ["plan", "--model", str(path), "--gpus-per-node", "8", "--tp", "2", "--pp", "4", "--seq-length", "64"]
    args = build_parser().parse_args([*argv, "--global-batch-size", "8", "--activation-checkpointing", "full"])
    spec, cluster, job, layouts = inputs(args)
    result = advisor.plan(spec, job, cluster, layouts, args.efficiency)
    (e,) = shown(result, args.top, args.all)
    return spec, job, e


def test_derived_stages_equal_their_own_simulation(pp4):
    from meshlm.compat import pipeline_passes_integers
    from meshlm.plan import simulate as sim

    if not pipeline_passes_integers():
        pytest.skip("this torch refuses a mixture of experts under pipeline parallel (engines/pipeline.py)")

    spec, job, e = pp4
    reduced = {r["rank"]: r for r in sim.simulate(spec, job, e)}
    derived = [r for r in reduced.values() if "derived_from" in r]
    assert [r["stage"] for r in derived] == [2], "stages 1 and 2 are of one kind; only stage 2 is derived"
    cfg = sim.train_config(spec, job, e, sim.model_dir(spec))
    for r in derived:
        full = sim.simulate_rank(spec, cfg, r["rank"], e.candidate.world)
        full.update(sim.startup_peak(cfg, sim._Vocab(spec.vocab), r["rank"], e.candidate.world, sim._fake_rank))
        assert {q: r[q] for q in QUANTITIES} == {q: full[q] for q in QUANTITIES}
        assert r["peak"] != reduced[r["derived_from"]]["peak"]  # the in-flight micro-batch it holds less
