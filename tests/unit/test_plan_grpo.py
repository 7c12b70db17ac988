"""The planner's price of a GRPO step (plan/grpo_cost.py): the generation phase (one group's KV cache and logits,
beside the states and the gathered units, not the training activations; under pp a cache per batch in flight), the
layouts that generate (pp and ep, not cp), the reference with --grpo.beta > 0 as
DPO's, one chunk of the completions' log-probabilities, the decode time; other objectives' plans unchanged."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from meshlm import cli
from meshlm import config as config_mod
from meshlm.plan.cluster import make_cluster
from meshlm.plan.comm import collectives
from meshlm.plan.grpo_cost import in_flight
from meshlm.plan.job import Job
from meshlm.plan.memory import GATHERED, memory
from meshlm.plan.shape import StageShape
from meshlm.plan.spec import load_model

SPEC = load_model("llama-7b")
STAGE = StageShape(SPEC.layers, first=True, last=True, in_flight=1, tp=1)
GRPO = Job(seq_length=1024, micro_batch=8, objective="grpo", grpo_group=8, grpo_new_tokens=512)


def _mem(job: Job, strategy: str = "zero3", n: int = 8, stage: StageShape = STAGE, ac: bool = False, **kw):
    return memory(SPEC, job, stage, strategy, n, n, job.micro_batch, ac, False, **kw)


def test_generation_phase_kv_cache_and_logits():
    m = _mem(GRPO)
    kv = 2 * SPEC.layers * 8 * 1024 * SPEC.kv_heads * SPEC.head_dim * 2  # k and v, bf16, one group
    assert m.generation["KV cache (a decode batch x seq length)"] == kv
    assert m.generation["prefill logits"] == 8 * 512 * SPEC.vocab * 2
    tp2 = _mem(GRPO, stage=dataclasses.replace(STAGE, tp=2)).generation
    assert tp2["KV cache (a decode batch x seq length)"] == kv // 2  # the heads split
    longer = _mem(dataclasses.replace(GRPO, seq_length=2048)).generation["KV cache (a decode batch x seq length)"]
    assert longer == 2 * kv
    # a rank decodes --micro-batch-size rows of its groups together: micro-batches of 32 are 4 groups of 8 at once
    wide = _mem(dataclasses.replace(GRPO, micro_batch=32)).generation["KV cache (a decode batch x seq length)"]
    assert wide == 4 * kv
    # the cache is gone before training: the peak is the larger phase, never their sum
    states, temp = sum(m.states.values()), sum(m.temp.values())
    assert m.gpu_total == max(states + temp + m.act.peak, states + temp + sum(m.generation.values()), states + m.step)
    # a group of 64 (micro-batches of 8, accumulated) under recompute: its cache outweighs the activations
    big = _mem(dataclasses.replace(GRPO, grpo_group=64), ac=True)
    generating = sum(big.states.values()) + sum(big.temp.values()) + sum(big.generation.values())
    assert big.gpu_total == generating > sum(big.states.values()) + sum(big.temp.values()) + big.act.peak


def test_pipelined_decode_a_cache_per_batch_in_flight():
    """Under pp each stage holds a KV cache for every decode batch in flight (one per stage at most), over its own
    layers only."""
    assert in_flight(GRPO, 1, 8) == 1 and in_flight(GRPO, 4, 8) == 4  # 8 batches of 8 rows fill 4 stages
    assert in_flight(GRPO, 4, 2) == 2  # 16 completions are two batches: two in flight
    assert in_flight(Job(seq_length=1024, micro_batch=8), 4, 8) == 1  # no decoding outside GRPO
    quarter = dataclasses.replace(STAGE, layers=SPEC.layers // 4, last=False)
    one = _mem(GRPO, stage=quarter, pipelined=True).generation
    kv = 2 * SPEC.layers // 4 * 8 * 1024 * SPEC.kv_heads * SPEC.head_dim * 2  # this stage's layers, one batch
    assert one == {
        "KV cache (a decode batch x seq length)": kv,
        "prefill logits": 0,  # the head's logits are the last stage's
        "sampling logits and probabilities": 0,
    }
    four = _mem(GRPO, stage=quarter, pipelined=True, decoding=4).generation
    assert four == {**one, "KV caches of the other decode batches in flight (pp)": 3 * kv}


def test_gathered_generation_prices_the_whole_model():
    """--grpo.gather-for-generation (the default): under zero3/hsdp every rank holds the whole model, in the dtype
    FSDP gathers, while decoding (in place of the units a forward gathers); false, or where the parameters are
    gathered anyway (ddp, zero2, a pipeline stage), nothing more."""
    on, off = _mem(GRPO), _mem(dataclasses.replace(GRPO, grpo_gather=False))
    whole = STAGE.params(SPEC) * 2  # bf16
    assert on.generation[GATHERED] == whole - on.temp["gathered units"] > 0
    assert GATHERED not in off.generation
    assert sum(on.generation.values()) == sum(off.generation.values()) + on.generation[GATHERED]
    # a group of 64 under recompute: the generation phase is the peak, the whole model in it
    big = dataclasses.replace(GRPO, grpo_group=64)
    assert (
        _mem(big, ac=True).gpu_total
        == _mem(dataclasses.replace(big, grpo_gather=False), ac=True).gpu_total + (on.generation[GATHERED])
    )
    assert _mem(GRPO, "hsdp").generation[GATHERED] == on.generation[GATHERED]
    quarter = dataclasses.replace(STAGE, layers=SPEC.layers // 4, last=False)
    for strategy, kw in (("ddp", {}), ("zero2", {}), ("zero3", {"stage": quarter, "pipelined": True})):
        assert GATHERED not in _mem(GRPO, strategy, **kw).generation, strategy


def _gathers(job: Job, strategy: str = "zero3", pp: int = 1) -> list:
    cluster = make_cluster(nodes=1, gpus_per_node=8)
    comm = collectives(SPEC, job, cluster, strategy, 8, 8, 1, pp, STAGE, 0, 8, False)
    return [c for c in comm if "grpo" in c.what]


def test_generation_gathers_priced():
    """Decoding under zero3/hsdp gathers the whole model once a step (--grpo.gather-for-generation), or every unit
    again for each token of each decode batch (false): exposed, not overlapped, and the step slower for it."""
    psi, units = STAGE.params(SPEC), SPEC.layers + 1
    (once,) = _gathers(GRPO)
    assert (once.kind, once.payload, once.calls, once.overlapped) == ("all_gather", psi * 2, units, False)
    (per_token,) = _gathers(dataclasses.replace(GRPO, grpo_gather=False))
    forwards = 8 * 512  # 8 micro-batches of one group each, 512 new tokens each
    assert (per_token.payload, per_token.calls, per_token.overlapped) == (forwards * psi * 2, forwards * units, False)
    assert per_token.seconds > 1000 * once.seconds
    assert _gathers(GRPO, "hsdp")[0].group == "dp_shard"
    for strategy, pp in (("ddp", 1), ("zero2", 1), ("zero3", 4)):  # gathered anyway, or nothing to gather
        assert not _gathers(dataclasses.replace(GRPO, grpo_gather=False), strategy, pp), strategy
    assert not _gathers(Job(seq_length=1024, micro_batch=8))


def test_reference_only_with_beta_and_a_logp_chunk():
    assert "reference" not in _mem(GRPO).states
    ref = _mem(dataclasses.replace(GRPO, grpo_beta=0.04)).states["reference"]
    dpo = _mem(Job(seq_length=1024, micro_batch=8, objective="dpo")).states["reference"]
    assert ref == dpo  # as DPO's: bf16 shards of a frozen copy
    assert "reference" not in _mem(dataclasses.replace(GRPO, grpo_beta=0.04, lora_r=16)).states  # LoRA's base
    assert _mem(GRPO).temp["completion log-probabilities, one chunk (grpo)"] == 3 * 4 * (1 << 24)
    sft = _mem(Job(seq_length=1024, micro_batch=8))
    assert not sft.generation and "completion log-probabilities, one chunk (grpo)" not in sft.temp


def _plan(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--model-name", "llama-7b", "--gpus-per-node", "8", *args, "--json"])
    assert e.value.code == 0
    return json.loads(capsys.readouterr().out)


def test_plan_objective_grpo(capsys):
    grpo = ["--objective", "grpo", "--micro-batch-size", "8", "--seq-length", "1024"]
    sft = _plan(["--micro-batch-size", "8", "--seq-length", "1024"], capsys)
    plan = _plan([*grpo, "--grpo.max-new-tokens", "512", "--grpo.beta", "0.04"], capsys)
    assert {"grpo_group": 8, "grpo_new_tokens": 512, "grpo_beta": 0.04}.items() <= plan["job"].items()
    assert not any(k.startswith("grpo") for k in sft["job"]) and "generation" not in sft["layouts"][0]
    assert all(e["cp"] == 1 for e in plan["layouts"]) and any(e["cp"] > 1 for e in sft["layouts"])
    best = {e["layout"]: e for e in plan["layouts"]}
    same = {e["layout"]: e for e in sft["layouts"]}
    win = plan["recommendation"]["layout"]
    assert best[win]["generation"]["KV cache (a decode batch x seq length)"] > 0
    assert best[win]["step_s"] > same[win]["step_s"]  # decoding 512 tokens per group costs time
    command = [a for a in shlex.split(plan["recommendation"]["command"]) if a != "--pretrained"]  # a flag
    cfg = config_mod.load(None, config_mod.parse_args(command[4:]))
    assert (cfg.objective, cfg.grpo.group_size, cfg.grpo.max_new_tokens, cfg.grpo.beta) == ("grpo", 8, 512, 0.04)
    assert cfg.grpo.gather_for_generation and plan["job"]["grpo_gather"]
    per_layer = _plan([*grpo, "--strategy", "zero3", "--grpo.gather-for-generation", "false"], capsys)
    assert "--grpo.gather-for-generation false" in per_layer["recommendation"]["command"]
    assert all(GATHERED not in e["generation"] for e in per_layer["layouts"])
    gathered = _plan([*grpo, "--strategy", "zero3"], capsys)["layouts"]
    assert min(e["step_s"] for e in per_layer["layouts"]) > min(e["step_s"] for e in gathered)


def test_plan_grpo_offers_pipelines_not_cp(capsys):
    """GRPO generates under pp (config.py grpo_layout_problem, which the planner asks): a model whose replicated
    states fit no GPU gets pipelined layouts, each stage's KV caches priced for the batches in flight; cp is
    refused with train's own line."""
    grpo = ["--objective", "grpo", "--micro-batch-size", "8", "--seq-length", "1024"]
    plan = _plan([*grpo, "--strategy", "ddp"], capsys)  # llama-7b's 16 bytes a parameter: 100 GiB replicated
    fits = [e for e in plan["layouts"] if e["fits"]]
    assert fits and all(e["tp"] * e["pp"] > 1 for e in fits)
    piped = [e for e in fits if e["pp"] > 1]
    assert piped and plan["recommendation"]["layout"] in {e["layout"] for e in fits}
    for e in piped:  # 8 micro-batches of 8 rows: a batch in flight on every stage
        gen = e["generation"]
        assert (
            gen["KV caches of the other decode batches in flight (pp)"]
            == (e["pp"] - 1) * gen["KV cache (a decode batch x seq length)"]
        )
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--model-name", "llama-7b", "--gpus-per-node", "8", *grpo, "--parallel.cp", "2"])
    assert e.value.code == 2
    assert "--objective grpo generates under" in capsys.readouterr().err
