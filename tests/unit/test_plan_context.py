"""The planner's terms for long sequences (plan/memory.py, plan/advisor.py, plan/comm.py): context parallel, the
chunked loss and activation offload, and the advisor recommending cp when a sequence fits no other way. The
measured side is benchmarks/long_sequences.py (BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm import config as config_mod
from meshlm.layout import resolve
from meshlm.plan import advisor
from meshlm.plan.activations import activations
from meshlm.plan.advisor import Candidate
from meshlm.plan.cluster import make_cluster
from meshlm.plan.comm import collectives
from meshlm.plan.job import Job, train_keys
from meshlm.plan.memory import memory
from meshlm.plan.shape import StageShape
from meshlm.plan.spec import load_model

GiB = 2**30


def _act(spec, job, cp=1, tp=1, ac=False):
    return activations(spec, job, StageShape(spec.layers, True, True, 1, tp, cp), 1, ac, bf16_params=True)


def test_cp_divides_a_ranks_activations():
    """Ulysses (32 heads over 4 ranks): every per-token part of a block, the embedding and the head shrink 4x."""
    spec, job = load_model("llama-7b"), Job(seq_length=32768, precision="bf16", chunked_loss="off")
    whole, cp4 = _act(spec, job), _act(spec, job, cp=4)
    assert cp4.per_layer * 4 == whole.per_layer
    assert cp4.parts["blocks"] * 4 == whole.parts["blocks"]
    assert cp4.parts["head"] * 4 == whole.parts["head"]
    assert cp4.peak < whole.peak / 3.9


def test_allgather_keeps_the_whole_sequences_keys_and_values_and_ring_does_not():
    """8 kv heads over tp 2 x cp 8 do not split: ring (auto) keeps this rank's k and v only, as ulysses at cp 4
    does per token; allgather (chosen) saves each block's whole k and v on every rank."""
    spec = dataclasses.replace(load_model("llama-7b"), kv_heads=8)
    job = Job(seq_length=32768, precision="bf16")
    st = StageShape(spec.layers, True, True, 1, 2, 8)
    assert st.cp_scheme(spec) == "ring" and st.cp_scheme(spec, "allgather") == "allgather"
    assert StageShape(spec.layers, True, True, 1, 2, 4).cp_scheme(spec) == "ulysses"
    local = 32768 // 8
    extra = 2 * 2 * (8 * spec.head_dim // 2) * local * 7  # bf16 k and v of the other 7 ranks' tokens
    cp4 = _act(spec, job, cp=4, tp=2).per_layer // 2
    assert _act(spec, job, cp=8, tp=2).per_layer == cp4
    gathered = dataclasses.replace(job, cp_attention="allgather")
    assert _act(spec, gathered, cp=8, tp=2).per_layer - cp4 == extra


def test_the_chunked_loss_keeps_no_logits():
    """At 8k tokens and a 128k vocabulary the whole logits' fp32 log-probabilities (4 GiB) and their gradients leave
    the peak: what is left is one chunk's (parallel/loss.py CHUNK_ELEMENTS)."""
    spec = dataclasses.replace(load_model("llama-7b"), vocab=128256)
    off, auto = (Job(seq_length=8192, precision="bf16", chunked_loss=c) for c in ("off", "auto"))
    whole, chunked = _act(spec, off, ac=True), _act(spec, auto, ac=True)
    logits = 4 * spec.vocab * 8192
    assert whole.parts["head"] - chunked.parts["head"] == logits
    assert whole.peak - chunked.peak >= logits


def test_the_fused_loss_weight_gradient_is_a_second_copy_only_beside_ddp_or_fsdp():
    """The fused loss makes the head weight's fp32 gradient in forward. In one process it becomes the weight's
    gradient (a state, not counted again); DDP copies it into its gradient bucket in the head's backward, so until
    then it is a second copy: ddp x4 and cp 4 plan one [vocab x hidden] fp32 tensor more than one process at the
    same tokens per rank, as measured."""
    spec, job = load_model("llama-7b"), Job(seq_length=4096, precision="fp32")
    part = "head weight gradient (fused loss)"

    def act(strategy, dp, cp=1, shard=1):
        stage = StageShape(spec.layers, True, True, 1, 1, cp)
        return memory(
            spec, dataclasses.replace(job, seq_length=4096 * cp), stage, strategy, dp, shard, 1, False, False
        ).act

    one, ddp, cp4 = act("single", 1), act("ddp", 4), act("ddp", 1, cp=4)
    assert part not in one.parts and ddp.parts[part] == cp4.parts[part] == 4 * spec.vocab * spec.hidden
    assert ddp.peak - one.peak == ddp.parts[part]
    assert part in act("zero3", 4, shard=4).parts and part not in act("ddp", 1).parts  # FSDP; no DDP on one rank


def test_activation_offload_moves_the_blocks_to_host_memory():
    spec = load_model("llama-7b")
    job = Job(seq_length=16384, precision="bf16", activation_offload=True)
    stage = StageShape(spec.layers, True, True, 1, 1)
    m = memory(spec, job, stage, "zero3", 8, 8, 1, True, False)
    plain = memory(spec, dataclasses.replace(job, activation_offload=False), stage, "zero3", 8, 8, 1, True, False)
    assert m.act.parts["blocks"] == 2 * plain.act.per_layer_ckpt
    assert m.cpu == plain.act.parts["blocks"] - m.act.parts["blocks"] > 0
    assert m.gpu_total < plain.gpu_total


def test_cp_collectives_run_over_the_cp_ranks():
    spec = load_model("llama-7b")
    job = Job(seq_length=32768, precision="bf16")
    cluster = make_cluster(1, 8, "h100", None, None, "nvlink", "infiniband", "2TiB", "bf16")
    stage = StageShape(spec.layers, True, True, 1, 1, 4)
    comm = collectives(spec, job, cluster, "zero3", 8, 8, 1, 1, stage, 0, 1, False)
    cp = {c.kind: c for c in comm if c.group == "cp"}
    assert sorted(cp) == ["all_gather", "all_to_all"] and {c.ranks for c in cp.values()} == {4}
    # q, k, v, out: bf16 (zero3 computes and streams bf16), forward and backward
    assert cp["all_to_all"].payload == spec.layers * (2 * spec.hidden + 2 * spec.hidden) * (32768 // 4) * 4
    assert cp["all_gather"].payload == job.micro_batch * 32768 * 8  # the whole sequence's int64 position ids


def test_ring_passes_keys_values_and_their_gradients_around_the_cp_ranks():
    """cp 16 over 8 kv heads: ring. Each rank sends and receives k and v (bf16) 15 times in forward and again in
    backward, and their fp32 gradients 16 times."""
    spec = dataclasses.replace(load_model("llama-7b"), kv_heads=8)
    job = Job(seq_length=32768, precision="bf16")
    cluster = make_cluster(2, 8, "h100", None, None, "nvlink", "infiniband", "2TiB", "bf16")
    stage = StageShape(spec.layers, True, True, 1, 1, 16)
    comm = collectives(spec, job, cluster, "zero3", 16, 16, 1, 1, stage, 0, 1, False)
    ring = next(c for c in comm if c.group == "cp" and c.kind == "p2p")
    kv = spec.kv_heads * spec.head_dim * (32768 // 16)
    assert ring.payload == spec.layers * 2 * (2 * 15 * kv * (2 + 2) + 16 * 2 * kv * 4)


def test_candidates_split_sequences_that_divide():
    spec, cluster = (
        load_model("llama-7b"),
        make_cluster(1, 8, "h100", None, None, "nvlink", "infiniband", "2TiB", "bf16"),
    )
    cps = {c.cp for c in advisor.candidates(spec, cluster, (False,), seq=4096)}
    assert cps == {1, 2, 4, 8}
    assert {c.cp for c in advisor.candidates(spec, cluster, (False,), seq=4098)} == {1, 2}
    lay = Candidate("zero3", 2, 1, 1, 2, cp=4)
    assert lay.world == 8 and lay.grad_ranks == 8 and lay.shard_ranks == 8 and lay.name == "zero3 cp4"


def test_the_advisor_recommends_cp_when_the_sequence_does_not_fit_otherwise():
    """Llama-7B at 256k tokens on 8 x 80 GB: nothing without cp fits; the command it prints resolves in meshlm."""
    spec = dataclasses.replace(load_model("llama-7b"), max_positions=262144)
    cluster = make_cluster(1, 8, "h100", None, None, "nvlink", "infiniband", "2TiB", "bf16")
    job = Job(seq_length=262144, precision="bf16").check(spec, cluster.world)
    layouts = advisor.candidates(spec, cluster, (False, True), seq=job.seq_length)
    p = advisor.plan(spec, job, cluster, layouts)
    assert p.ranked and all(e.candidate.cp > 1 for e in p.ranked)
    assert any("no layout without context parallel fits 262144 tokens" in r for r in p.reasons), p.reasons
    keys = dict(train_keys(job, p.ranked[0]))
    cfg = config_mod.load(None, [(k, str(v)) for k, v in keys.items()])
    assert cfg.parallel.cp == p.ranked[0].candidate.cp
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=spec.hidden, num_attention_heads=spec.heads, num_hidden_layers=spec.layers)
    assert resolve(cfg, 8, hf).cp == cfg.parallel.cp


@pytest.mark.parametrize("bad", ["sometimes", "0", "-3"])
def test_chunked_loss_option_is_checked(bad):
    from meshlm.errors import MeshlmError

    with pytest.raises(MeshlmError, match="--chunked-loss must be auto, on, off"):
        Job(chunked_loss=bad).check(load_model("llama-7b"), 8)


@pytest.mark.parametrize("gpus, pp, ranks", [(2, 1, {0, 1}), (4, 2, {0, 3})])
def test_simulate_runs_a_cp_layout(capsys, gpus, pp, ranks):
    """`plan --simulate` runs zero3 x cp 2, and with pp 2 (whose stages pass a cp rank's part of each sequence),
    meshlm's own parallelize and step with the cp all-to-alls over the fake process group, on the built-in model:
    the ranks' states are the plan's, the peak within 15%."""
    import json

    from meshlm.cli import main

    try:
        main(
            ["plan", "--gpus-per-node", str(gpus), "--strategy", "zero3", "--cp", "2", "--pp", str(pp)]
            + ["--seq-length", "128", "--simulate", "--json"]
        )
    except SystemExit as done:
        assert done.code in (0, None)
    ranks_seen = {r["rank"]: r for r in json.loads(capsys.readouterr().out)["simulated"]}
    assert set(ranks_seen) == ranks
    for r in ranks_seen.values():
        assert abs(r["model_states"] / r["plan"]["model_states"] - 1) < 0.02, r
        assert abs(r["peak"] / r["plan"]["peak"] - 1) < 0.15, r


def test_the_printed_command_keeps_lora_and_float8():
    """What `plan` prices is what its command (and `--simulate` / `--validate`, which run train_keys) trains:
    without these keys `plan --validate --lora.r 8` measured a full fine-tune against a LoRA plan."""
    spec = load_model("llama-7b")
    cluster = make_cluster(1, 8, "h100", None, None, "nvlink", "infiniband", "2TiB", "bf16")
    job = Job(seq_length=2048, lora_r=16, lora_targets="q_proj,v_proj", float8="rowwise").check(spec, cluster.world)
    p = advisor.plan(spec, job, cluster, advisor.candidates(spec, cluster, (False, True), seq=job.seq_length))
    keys = dict(train_keys(job, p.ranked[0]))
    cfg = config_mod.load(None, [(k, str(v)) for k, v in keys.items()])
    assert (cfg.lora.r, cfg.lora.targets, cfg.float8) == (16, "q_proj,v_proj", "rowwise")
    plain = dict(train_keys(Job(seq_length=2048).check(spec, cluster.world), p.ranked[0]))
    assert not {"lora.r", "lora.targets", "float8"} & set(plain)
