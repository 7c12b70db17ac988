"""`meshlm plan` for mixtures of experts, in this process: the presets' parameter counts against the published
ones, memory and FLOPs (total parameters for the states, active ones for compute), expert parallel's
gathered units, all-to-all volume, --ep and the layouts it picks on 64-512 GPUs. The multi-rank
`--simulate` of the presets is benchmarks/moe_plan.py (minutes)."""

from __future__ import annotations

import re

import pytest
import torch

from meshlm.cli import build_parser
from meshlm.plan import advisor
from meshlm.plan.cluster import make_cluster
from meshlm.plan.comm import collectives
from meshlm.plan.job import Job
from meshlm.plan.memory import memory
from meshlm.plan.shape import StageShape
from meshlm.plan.spec import load_model


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen3-235b-a22b")


def test_presets_count_the_published_totals_and_active_parameters(qwen):
    """Qwen3-235B-A22B: 235B total, 22B active; DeepSeek-V3: 671B total, 37B active (their model cards)."""
    assert qwen.params / 1e9 == pytest.approx(235.1, abs=0.1)
    assert qwen.active_params / 1e9 == pytest.approx(22.2, abs=0.1)
    assert qwen.experts == 128 and qwen.active_experts == 8 and qwen.tp_attention
    ds = load_model("deepseek-v3")
    assert ds.params / 1e9 == pytest.approx(671.0, abs=0.1)
    assert ds.active_params / 1e9 == pytest.approx(37.6, abs=0.1)
    assert ds.experts == 256 and ds.tp_attention  # MLA: meshlm splits its heads (its registry entry's plan_entries)


def _stage(spec, tp=1, ep=1):
    return StageShape(spec.layers, True, True, 1, tp, ep=ep)


def test_expert_parallel_keeps_the_states_and_gathers_only_local_experts(qwen):
    """Under FSDP ep moves no state (experts over ep x efsdp = the shard); FSDP's gathered block shrinks to its
    dense part plus experts / ep."""
    job, n = Job(seq_length=4096, precision="bf16"), 64
    zero3 = memory(qwen, job, _stage(qwen), "zero3", n, n, 1, True, False)
    ep = memory(qwen, job, _stage(qwen, ep=16), "zero3", n, n, 1, True, False)
    assert sum(ep.states.values()) == sum(zero3.states.values())
    experts = qwen.expert_layer_params
    assert _stage(qwen, ep=16).gathered_unit(qwen) == qwen.layer_params - experts + experts // 16
    assert sum(ep.temp.values()) < sum(zero3.temp.values())


def test_all_to_all_volume_per_moe_layer(qwen):
    """Per block and micro-batch: k copies of each token's hidden state out and back, forward and backward
    (bf16), over the expert group; the payload is what a rank sends, and its own share does not travel (wire =
    payload x (n-1)/n, as cp's all-to-alls)."""
    job, cluster, n, ep = Job(seq_length=4096, precision="bf16", micro_batch=1), make_cluster(8, 8), 64, 8
    st = _stage(qwen, ep=ep)
    out = collectives(qwen, job, cluster, "zero3", n, n, 1, 1, st, 0, 1, False)
    a2a = [c for c in out if c.kind == "all_to_all"]
    assert len(a2a) == 1 and a2a[0].ranks == ep and a2a[0].calls == 4 * qwen.layers
    copies = 4096 * qwen.active_experts * qwen.hidden
    assert a2a[0].payload == qwen.layers * copies * (2 * 2 + 2 * 2)
    assert a2a[0].wire == pytest.approx(a2a[0].payload * (ep - 1) / ep)
    plain = collectives(qwen, job, cluster, "zero3", n, n, 1, 1, _stage(qwen), 0, 1, False)
    assert not [c for c in plain if c.kind == "all_to_all"]
    gathered = sum(c.payload for c in out if c.kind == "all_gather")
    assert gathered < sum(c.payload for c in plain if c.kind == "all_gather") / 4  # experts / 8 of the weights


def test_tp_all_reduces_only_attention_in_moe_blocks(qwen):
    """Under TP a MoE block's experts are split whole and reached by the dispatch's all-to-alls: its only
    activation all-reduces are attention's output (forward) and input gradient (backward), where a dense block
    adds the MLP's two. (`plan --validate` of zero2 tp2 ep2 on a tiny Qwen3-MoE measured 6 activation-sized
    all-reduces per step: 2 per block of 2 and the vocabulary-parallel embedding's and head's; 1.66x planned
    with 4 per block.)"""
    job, cluster = Job(seq_length=4096, precision="bf16", micro_batch=1), make_cluster(8, 8)
    out = collectives(qwen, job, cluster, "zero3", 32, 32, 2, 1, _stage(qwen, tp=2), 0, 1, False)
    blocks = next(c for c in out if c.kind == "all_reduce" and c.what.startswith("activations"))
    assert blocks.calls == 2 * qwen.layers
    assert blocks.payload == qwen.layers * 4096 * qwen.hidden * (2 + 2)
    dense = load_model("llama-7b")
    out = collectives(dense, job, cluster, "zero3", 32, 32, 2, 1, _stage(dense, tp=2), 0, 1, False)
    assert next(c for c in out if c.kind == "all_reduce" and c.what.startswith("activations")).calls == 4 * 32


def _plan(*args):
    from meshlm.plan.cli import inputs

    ns = build_parser().parse_args(["plan", *args])
    spec, cluster, job, layouts = inputs(ns)
    return advisor.plan(spec, job, cluster, layouts, ns.efficiency), layouts


def test_ep_degrees_are_those_layout_resolve_accepts():
    """ep divides the sharded ranks and, with tp, the experts; only FSDP strategies; --ep keeps only those."""
    result, layouts = _plan("--model", "qwen3-235b-a22b", "--nodes", "8", "--gpus-per-node", "8", "--ep", "16")
    assert layouts and all(c.ep == 16 and c.strategy in ("zero3", "hsdp", "zero2") for c in layouts)
    assert all(c.shard % 16 == 0 and 128 % (16 * c.tp) == 0 for c in layouts)
    assert all(c.layout.degrees.ep == 16 and c.layout.degrees.dp_shard == c.shard for c in layouts)
    assert all("ep16" in e.candidate.name for e in result.estimates)


def test_flops_count_active_parameters(qwen):
    """MFU of a mixture of experts is of its active parameters (6 x 22B per token, not 6 x 235B)."""
    result, _ = _plan("--model", "qwen3-235b-a22b", "--nodes", "8", "--gpus-per-node", "8", "--ep", "64")
    best = result.estimates[0]
    tokens = 64 * 2048
    attention = 12 * qwen.layers * qwen.hidden * 2048
    model_flops = tokens * (6 * (qwen.active_params - qwen.embed_params) + attention)
    assert best.mfu == pytest.approx(model_flops / best.step_s / (64 * 989e12), rel=1e-6)


def test_grouped_experts_run_by_shapes_on_fake_fp32_tensors():
    """--simulate's stand-in: torch's fake grouped_mm takes only bf16 (before 2.15); transformers' grouped experts
    in fp32 then run by shapes, with gradients for the input and the grouped weights (and the name still exists)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from meshlm.compat import FakeTensorMode
    from meshlm.plan.simulate_standins import grouped_experts_by_shapes

    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"
    with FakeTensorMode(allow_non_fake_inputs=True):
        experts = Qwen3MoeExperts(config)
        x = torch.empty(6, 16, requires_grad=True)
        index, weights = torch.zeros(6, 2, dtype=torch.long), torch.full((6, 2), 0.5)
        try:  # torch 2.13 and 2.14 refuse fp32 (in two wordings); 2.15's fake grouped_mm takes it
            experts(x, index, weights)
        except RuntimeError as e:
            assert re.search("BF16|BFloat16", str(e)), e
        with grouped_experts_by_shapes():
            out = experts(x, index, weights)
            out.sum().backward()
    assert out.shape == (6, 16) and x.grad.shape == (6, 16)
    assert experts.gate_up_proj.grad.shape == experts.gate_up_proj.shape


def test_zero2_under_expert_parallel_holds_only_its_own_experts_whole(tmp_path, capsys):
    """zero2 keeps parameters gathered from forward to backward; under ep x tp a rank gathers only its own
    experts (experts / (ep x tp)), not experts / tp. `plan --simulate` of zero2 tp2 ep2 on 4 fake ranks (meshlm's
    own FSDP and expert sharding) holds the plan's model states (with experts / tp the plan was 1.23x)."""
    import json

    from transformers import Qwen3MoeConfig

    from meshlm.cli import main

    Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128,
    ).save_pretrained(tmp_path)  # fmt: skip
    try:
        main(
            ["plan", "--model", str(tmp_path), "--gpus-per-node", "4", "--precision", "fp32", "--seq-length", "32"]
            + ["--strategy", "zero2", "--tp", "2", "--ep", "2", "--pp", "1", "--cp", "1", "--simulate", "--json"]
        )
    except SystemExit as done:
        assert done.code in (0, None)
    ranks = json.loads(capsys.readouterr().out)["simulated"]
    assert [r["layout"] for r in ranks] == ["zero2 tp2 ep2"] * 2
    for r in ranks:
        assert abs(r["model_states"] / r["plan"]["model_states"] - 1) < 0.02, r


def test_ep_composes_with_cp(qwen):
    """ep x cp candidates are those layout.resolve accepts (ep divides the data-parallel shard, cp ranks not
    counted); a rank dispatches its 1/cp of the tokens, and each experts unit shards over (shard / ep) x cp."""
    shape = ("--model", "qwen3-235b-a22b", "--nodes", "8", "--gpus-per-node", "8")
    result, layouts = _plan(*shape, "--ep", "8", "--cp", "2")
    assert layouts and all(c.ep == 8 and c.cp == 2 and c.shard % 8 == 0 for c in layouts)
    assert all(c.layout.degrees.dp_shard == c.shard and c.layout.degrees.cp == 2 for c in layouts)
    assert all("cp2 ep8" in e.candidate.name for e in result.estimates)
    job, cluster, n = Job(seq_length=4096, precision="bf16", micro_batch=1), make_cluster(8, 8), 32
    by_cp = {}
    for cp in (1, 2):
        st = StageShape(qwen.layers, True, True, 1, 1, cp, 8)
        by_cp[cp] = collectives(qwen, job, cluster, "zero3", n, n * cp, 1, 1, st, 0, 1, False)
    dispatch = [next(c for c in by_cp[cp] if c.group == "experts") for cp in (1, 2)]
    assert dispatch[1].payload * 2 == dispatch[0].payload and dispatch[1].ranks == 8
    gathers = [c for c in by_cp[2] if c.group == "efsdp"]
    assert gathers and all(c.ranks == n * 2 // 8 for c in gathers)


def test_simulate_runs_expert_parallel_with_cp(tmp_path, capsys):
    """`plan --simulate` of zero3 cp2 ep2 on 4 fake ranks (meshlm's own mesh, expert dispatch and cp attention):
    every simulated rank holds the plan's model states."""
    import json

    from transformers import Qwen3MoeConfig

    from meshlm.cli import main

    Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128,
    ).save_pretrained(tmp_path)  # fmt: skip
    try:
        main(
            ["plan", "--model", str(tmp_path), "--gpus-per-node", "4", "--precision", "fp32", "--seq-length", "32"]
            + ["--strategy", "zero3", "--tp", "1", "--ep", "2", "--pp", "1", "--cp", "2", "--simulate", "--json"]
        )
    except SystemExit as done:
        assert done.code in (0, None)
    ranks = json.loads(capsys.readouterr().out)["simulated"]
    assert ranks and all(r["layout"] == "zero3 cp2 ep2" for r in ranks)
    for r in ranks:
        assert abs(r["model_states"] / r["plan"]["model_states"] - 1) < 0.02, r
