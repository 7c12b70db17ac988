"""--objective dpo (objectives/dpo.py, objectives/dpo_loss.py, data/preference.py) against TRL's DPOTrainer and
against one process in every layout, with and without LoRA, plus export -> generate and bad input.

The layouts run several to a launch (tests/helpers/family_runs.py): one launch of 1, 2 and 4 ranks each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import TINY, meshlm_here, metrics, run_meshlm
from helpers.family_runs import launch

pytestmark = pytest.mark.slow

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
# Held-out pairs every 3 steps; accumulation 2; the built-in pairs' responses run from 1 to 24 bytes (uneven).
DPO = [
    *TINY,
    "--seq-length",
    "128",
    "--objective",
    "dpo",
    "--max-steps",
    "3",
    "--grad-accum",
    "2",
    "--eval-every",
    "3",
    "--eval-fraction",
    "0.1",
    "--save-final",
    "false",
]
LORA = ["--lora.r", "8"]
ONE = {"single": [], "single-lora": LORA}  # global batch 8 everywhere: micro-batch x accumulation 2 x dp
TWO = {
    "tp": ["--parallel.tp", "2", "--micro-batch-size", "4"],
    "pp-1f1b": ["--parallel.pp", "2", "--parallel.schedule", "1f1b", "--micro-batch-size", "4"],
}
FOUR = {
    "ddp": ["--strategy", "ddp", "--micro-batch-size", "1"],
    "zero3": ["--strategy", "zero3", "--micro-batch-size", "1"],
    "hsdp": ["--strategy", "hsdp", "--parallel.shard-size", "2", "--micro-batch-size", "1"],
    "fsdp-tp": ["--strategy", "fsdp", "--parallel.tp", "2", "--micro-batch-size", "2"],
}

CP_PP = ["--parallel.cp", "2", "--parallel.pp", "2", "--parallel.schedule", "1f1b", "--micro-batch-size", "4"]
CP_PP_RUNS = {"cp-pp": [], "cp-pp-lora": [*LORA, "--parallel.cp-attention", "ring"]}  # frozen copy; LoRA's base


def _with_lora(layouts: dict) -> dict:
    return {**layouts, **{f"{k}-lora": [*v, *LORA] for k, v in layouts.items()}}


def make_peer(root: Path) -> tuple[Path, list[dict]]:
    """What TRL and meshlm both get: a tiny Llama (transformers' config, random weights) with the byte tokenizer,
    a second one nearby (a reference that differs from the policy), and 8 built-in preference pairs.

    A reward is beta x (a sum of ~60 log-probabilities - the reference's): fp32 gives those sums to ~4e-6, so
    with references 0.02 away (log-ratios ~0.4) rewards differed from TRL's by 1e-5 relative, packed rows
    against padded ones being different matmuls. 0.05 away the log-ratios are a few nats, as in real DPO."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshlm.data.builtin import byte_tokenizer, preference_corpus

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "model")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root / "reference")
    pairs = preference_corpus(8, seed=3)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return root, pairs


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    return make_peer(tmp_path_factory.mktemp("peer"))


def matched_to_trl(root: Path) -> list[str]:
    """`meshlm train` options that run what _trl_trainer runs: the 8 pairs packed into one block (micro-batch 1),
    AdamW with TrainingArguments' betas and no weight decay, a constant lr."""
    return [
        "--model-name", root / "model", "--pretrained", "true", "--dataset-name", root / "pairs.jsonl",
        "--objective", "dpo", "--seq-length", "1024", "--micro-batch-size", "1", "--max-steps", "2",
        "--lr", "1e-3", "--warmup-steps", "0", "--min-lr-ratio", "1", "--weight-decay", "0", "--beta2", "0.999",
        "--log-every", "1", "--save-final", "false", "--progress", "false",
    ]  # fmt: skip


def _trl_trainer(peer, loss: str, beta: float, smoothing: float, ref_model=None, **kw):
    """TRL's DPOTrainer in fp32 on CPU over the 8 pairs (one batch). cDPO's label smoothing is
    2(1 - e) sigmoid - (1 - 2e) robust in TRL 1.x's terms (it moved smoothing from sigmoid to robust)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    root, pairs = peer
    losses = {"loss_type": [loss]}
    if smoothing:
        losses = {"loss_type": ["sigmoid", "robust"], "loss_weights": [2 * (1 - smoothing), -(1 - 2 * smoothing)]}
    args = DPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=8,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TrainingArguments turns bf16 on where the CPU has it
        beta=beta,
        label_smoothing=smoothing,
        max_length=None,
        save_strategy="no",
        **losses,
        **kw,
    )
    policy = LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    return DPOTrainer(
        model=policy,
        ref_model=ref_model,
        args=args,
        train_dataset=Dataset.from_list(pairs),
        processing_class=AutoTokenizer.from_pretrained(root / "model"),
    )


@pytest.mark.parametrize(
    "loss, beta, smoothing",
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("sigmoid_norm", 0.1, 0.0)],
)
def test_loss_rewards_and_gradient_match_trl(peer, loss, beta, smoothing):
    """On one batch of 8 pairs, against a reference that differs from the policy (so no term is trivially 0):
    meshlm's pairs (data/preference.py), packed into one row, through objectives/dpo_loss.py give TRL's loss,
    chosen and rejected rewards and gradient norm within 1e-5 relative, for each variant."""
    pytest.importorskip("trl")
    mine, theirs = one_batch_against_trl(peer, loss, beta, smoothing)
    assert min(abs(x) for x in theirs) > 1e-3
    for a, b in zip(mine, theirs):
        assert abs(a - b) <= 1e-5 * abs(b), (mine, theirs)


def one_batch_against_trl(peer, loss: str, beta: float, smoothing: float) -> tuple[list[float], list[float]]:
    """(meshlm's, TRL's) [loss, rewards/chosen, rewards/rejected, gradient norm] on the 8 pairs, one batch."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from meshlm.data.pack import labels_of
    from meshlm.data.preference import pair_documents
    from meshlm.objectives.dpo_loss import pair_losses, sequence_logps

    root, pairs = peer
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    ids, labels, positions = [], [], []
    for i, rec in enumerate(pairs):
        for doc, learned in pair_documents(rec, tokenizer, f"pair {i}"):
            ids, labels, positions = ids + doc, labels + labels_of(doc, learned), positions + list(range(len(doc)))
    ids, labels, positions = (torch.tensor([x]) for x in (ids, labels, positions))
    policy = LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    reference = LlamaForCausalLM.from_pretrained(root / "reference", dtype=torch.float32)
    with torch.no_grad():
        ref = sequence_logps(
            reference(input_ids=ids, position_ids=positions, use_cache=False).logits, labels, positions
        )
    logps = sequence_logps(policy(input_ids=ids, position_ids=positions, use_cache=False).logits, labels, positions)
    per_pair, stats = pair_losses(logps, ref[..., 0], loss, beta, smoothing)
    assert stats[0].item() == len(pairs)
    mine_loss = per_pair.sum() / stats[0]
    mine_loss.backward()
    mine = [mine_loss.item(), (stats[1] / stats[0]).item(), (stats[2] / stats[0]).item()]
    mine.append(torch.nn.utils.get_total_norm([p.grad for p in policy.parameters()]).item())

    trainer = _trl_trainer(peer, loss, beta, smoothing, ref_model=reference)
    trainer.model.train()
    theirs_loss = trainer.compute_loss(trainer.model, next(iter(trainer.get_train_dataloader())))
    theirs_loss.backward()
    logged = trainer._metrics["train"]
    theirs = [theirs_loss.item(), logged["rewards/chosen"][-1], logged["rewards/rejected"][-1]]
    theirs.append(torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters()]).item())
    return mine, theirs


def test_first_steps_match_trl_dpo_trainer(peer, tmp_path):
    """The trainer itself: `meshlm train --objective dpo` (one process, the 8 pairs packed into one block) and TRL's
    DPOTrainer on the same model, tokenizer, pairs and beta, two steps of AdamW at a constant lr. Step 1 compares
    the gradient norm (loss ln 2 and rewards 0: the reference is the policy before its first update, in both),
    step 2 loss, log-probabilities, rewards, accuracies and gradient norm after one identical update: all within 1e-5
    relative. A reward is beta x a difference of two log-probability sums, so its rounding is that of the sums: its
    1e-5 is of beta x the sum (observed on one CPU: rewards/rejected 3.3e-7 off at 0.0246, 1.4e-5 of it and 6.8e-8 of
    beta x its sum of -49.3; every log-probability within 1.6e-7)."""
    pytest.importorskip("trl")
    root, _ = peer
    run_meshlm("train", *matched_to_trl(root), "--output-dir", tmp_path / "meshlm")
    mine = metrics(tmp_path / "meshlm")
    trainer = _trl_trainer(peer, "sigmoid", 0.1, 0.0, max_steps=2, learning_rate=1e-3, lr_scheduler_type="constant")
    trainer.args.logging_steps = 1
    trainer.train()
    theirs = [r for r in trainer.state.log_history if "grad_norm" in r]
    assert len(mine) == len(theirs) == 2 and mine[0]["target_tokens"] > 0
    assert mine[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and mine[0]["rewards/chosen"] == 0.0
    sums = {"rewards/chosen": ["logps/chosen"], "rewards/rejected": ["logps/rejected"]}
    sums["rewards/margins"] = sums["rewards/chosen"] + sums["rewards/rejected"]
    keys = ("loss", "grad_norm", "logps/chosen", "logps/rejected", *sums, "rewards/accuracies")
    for key in keys:
        for step, (a, b) in enumerate(zip(mine, theirs), 1):
            scale = max([abs(b[key])] + [0.1 * abs(b[k]) for k in sums.get(key, [])])  # beta 0.1
            assert abs(a[key] - b[key]) <= 1e-5 * scale, (step, key, a[key], b[key])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every layout's run, three launches: single (with and without LoRA; the full run saved for export; an sft
    LoRA run for its memory), then 2 ranks (tp, pp; pp also with the precomputed reference, tp with sequence
    parallel), then 4 ranks."""
    root = tmp_path_factory.mktemp("dpo")
    one = {name: [*DPO, *args, "--micro-batch-size", "4"] for name, args in ONE.items()}
    one["single"] += ["--save-final", "true"]  # for export
    one["sft-lora"] = [*DPO, *LORA, "--objective", "sft", "--micro-batch-size", "4"]
    two = {name: [*DPO, *args] for name, args in _with_lora(TWO).items()}
    two["pp-precomputed"] = [*DPO, *TWO["pp-1f1b"], "--dpo.precompute-reference", "true"]
    two["tp-sp"] = [*DPO, *TWO["tp"], "--parallel.sequence-parallel", "true"]  # the sequence split between blocks
    # context parallel: each pair's documents split over the cp ranks (ulysses, with LoRA; ring's zig-zag chunks)
    two["cp-lora"] = [*DPO, "--parallel.cp", "2", "--micro-batch-size", "4", *LORA]
    two["cp-ring"] = [*DPO, "--parallel.cp", "2", "--micro-batch-size", "4", "--parallel.cp-attention", "ring"]
    for strategy in ("zero3", "zero2"):  # bf16: FSDP's shards; master weights' working copies (objectives/dpo.py)
        two[f"{strategy}-bf16"] = [*DPO, "--strategy", strategy, "--micro-batch-size", "2", "--mixed-precision", "bf16"]
    four = {name: [*DPO, *args] for name, args in _with_lora(FOUR).items()}
    # cp 2 x pp 2: the last stage adds each document's log-probabilities over its cp group (frozen copy, ulysses;
    # LoRA's base, ring's zig-zag chunks)
    four.update({name: [*DPO, *CP_PP, *args] for name, args in CP_PP_RUNS.items()})
    for world, layouts in ((1, one), (2, two), (4, four)):
        cases = [
            {"id": name, "kind": "train", "args": [str(a) for a in [*args, "--output-dir", root / name]]}
            for name, args in layouts.items()
        ]
        results = launch(world, {"cases": cases}, root / "launch")
        assert not [r["error"] for r in results.values() if "error" in r], results
    return root


def _rel(a: list[float], b: list[float]) -> float:
    """max |a - b| / max |b| over the steps (rewards start at exactly 0: policy = reference)."""
    scale = max(abs(x) for x in b) or 1.0
    return max(abs(x - y) for x, y in zip(a, b)) / scale


@pytest.mark.parametrize(
    "name", [*_with_lora(TWO), *_with_lora(FOUR), "pp-precomputed", "tp-sp", "cp-lora", "cp-ring", *CP_PP_RUNS]
)
def test_layout_matches_one_process(runs, name):
    """Losses and gradient norms 1e-4 relative, rewards and log-probabilities 1e-4 of their largest value, on the
    training rows and the held-out pairs, against one process with the same reference (LoRA: its base)."""
    rows = metrics(runs / name)
    ref = metrics(runs / ("single-lora" if name.endswith("-lora") else "single"))
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        assert max(abs(r[key] - w[key]) / abs(w[key]) for r, w in zip(rows, ref)) <= 1e-4, key
    for key in [*REWARDS, *(f"eval_{k}" for k in REWARDS), "eval_loss"]:
        got, want = [r[key] for r in rows if key in r], [w[key] for w in ref if key in w]
        assert len(got) == len(want) > 0 and _rel(got, want) <= 1e-4, (key, got, want)
    assert [r["rewards/accuracies"] for r in rows] == [w["rewards/accuracies"] for w in ref]
    assert ref[-1]["rewards/margins"] != 0 and ref[0]["rewards/chosen"] == 0.0  # the policy moved from the reference


def test_report_draws_the_rewards(runs):
    from meshlm.report import report

    assert (runs / "single" / "plots" / "rewards.png") in report(runs / "single")


def test_reference_memory_follows_the_layout(runs):
    """Without LoRA the reference is a frozen copy sharded like the policy: zero3 on 4 ranks holds a quarter of one
    process's reference (FSDP2 pads a shard by at most one row). With LoRA it is the base with adapters off: no
    reference bytes, and the run holds exactly what an sft LoRA run holds."""
    one, zero3 = metrics(runs / "single")[-1], metrics(runs / "zero3")[-1]
    assert one["reference_bytes"] > 0
    assert abs(zero3["reference_bytes"] - one["reference_bytes"] / 4) <= 0.01 * one["reference_bytes"] / 4
    assert zero3["model_state_bytes"] < one["model_state_bytes"] / 3
    for name in ("single-lora", "zero3-lora", "pp-precomputed"):
        assert metrics(runs / name)[-1]["reference_bytes"] == 0, name
    assert metrics(runs / "single-lora")[-1]["model_state_bytes"] == metrics(runs / "sft-lora")[-1]["model_state_bytes"]


@pytest.mark.parametrize("name, part", [("zero3-bf16", 4), ("zero2-bf16", 2)])
def test_bf16_reference_computes_what_the_policy_does_from_bf16_parameters(runs, name, part):
    """Under bf16 the reference keeps its parameters in the dtype the policy computes with: zero3's FSDP gathers
    bf16 from bf16 shards (on 2 ranks a quarter of one process's fp32 copy), zero2's master-weight layout holds a
    whole bf16 copy run without autocast, as its working copies are (a half). Either way its log-probabilities are
    exactly the policy's at step 1: loss ln 2, rewards exactly 0 (an fp32 zero2 reference under autocast gave
    7.8e-5), then the policy moves."""
    one, rows = metrics(runs / "single"), metrics(runs / name)
    share = one[-1]["reference_bytes"] / part
    assert abs(rows[-1]["reference_bytes"] - share) <= 0.01 * share, (rows[-1]["reference_bytes"], share)
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-7)
    assert rows[0]["rewards/chosen"] == rows[0]["rewards/rejected"] == 0.0
    assert rows[-1]["rewards/margins"] != 0 and math.isfinite(rows[-1]["loss"])


def test_dpo_run_exports_and_generates(runs, tmp_path):
    """train -> export -> generate: the export holds the trained policy (not the starting model) and generates."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from meshlm import config as config_mod
    from meshlm.models.build import build_model, load_tokenizer
    from meshlm.models.materialize import InitialWeights, materialize

    meshlm_here("export", "--checkpoint", runs / "single", "--out", tmp_path / "hf")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "add: 12 + 7 ="}\n{"prompt": "reverse: abc ="}\n')
    out = tmp_path / "gen.jsonl"
    meshlm_here("generate", "--model-name", tmp_path / "hf", "--prompts", prompts, "--out", out, "--max-new-tokens", 4)
    assert [json.loads(x)["token_ids"] for x in out.read_text().splitlines()][1]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    dcp_to_torch_save(runs / "single" / "checkpoints" / "step-3" / "state", tmp_path / "trained.pt")
    trained = torch.load(tmp_path / "trained.pt", weights_only=False)["model"]
    cfg = config_mod.load(str(runs / "single" / "config.toml"))
    start = build_model(cfg, load_tokenizer(cfg)[0], "meta")
    materialize(start, InitialWeights.of(start, cfg.seed), "cpu")
    key = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(exported[key], trained[key], rtol=0, atol=0)
    assert not torch.allclose(exported[key], start.state_dict()[key], atol=1e-6)


def test_verify_compares_dpo_rewards(runs):
    """meshlm verify's comparison on DPO rows: ddp passes, and rewards nudged by 1e-3 of their size fail it."""
    from meshlm import verify

    ref, rows = metrics(runs / "single"), metrics(runs / "ddp")
    case, tol = verify.Case("ddp", 4, "ddp"), verify.TOLERANCE
    ok = verify.compare(verify.Row("ddp", 4), ref, rows, {}, {}, case, tol)
    assert ok.status == "ok" and ok.rewards <= 1e-4, ok
    scale = max(abs(r["rewards/chosen"]) for r in ref)
    off = [dict(r, **{"rewards/chosen": r["rewards/chosen"] + 1e-3 * scale}) for r in rows]
    bad = verify.compare(verify.Row("ddp", 4), ref, off, {}, {}, case, tol)
    assert bad.status == "FAIL" and any(p.startswith("rewards difference") for p in bad.problems), bad.problems


def test_verify_command_on_dpo(tmp_path):
    """The whole `meshlm verify --objective dpo` command (one launch: it runs single and zero3 on 2 ranks as
    `meshlm train` subprocesses): every row ok with its rewards compared, zero3's state (the reference copy
    included) sharded, and what it writes: verify.json, each layout's run directory with DPO metrics. (ddp's
    rewards through verify's comparison: test_verify_compares_dpo_rewards, on the module's ddp run.)"""
    out = tmp_path / "verify"
    args = ["--arch.layers", "2", "--seq-length", "128", "--objective", "dpo", "--grad-accum", "2"]  # on the preset
    p = run_meshlm(
        *("verify", "tiny", "--nproc", 2, "--steps", 3, "--layouts", "zero3", "--keep", "--output-dir", out),
        *args,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "loss = pair mean over the global batch" in p.stdout.splitlines()[0]
    assert "--objective dpo: rewards and log-probabilities 0.0001" in p.stdout
    assert "rewards" in next(line for line in p.stdout.splitlines() if line.startswith("layout"))
    assert "verify: 1 of 1 layouts that ran match single" in p.stdout
    result = json.loads((out / "verify.json").read_text())
    rows = {r["layout"]: r for r in result["rows"]}
    assert list(rows) == ["single", "zero3"] and result["tolerance"]["rewards"] == 1e-4
    r = rows["zero3"]
    assert r["status"] == "ok" and not r["problems"] and r["rewards"] <= 1e-4, r  # NaN fails <=
    assert r["loss"] <= 1e-4 and len(r["losses"]) == 3, r
    assert r["state"] < 0.6  # a half per rank, and more
    for name in rows:  # the runs were DPO runs: loss ln 2 at step 1 (reference = policy), then the policy moves
        steps = metrics(out / name)
        assert [r["step"] for r in steps] == [1, 2, 3], name
        assert steps[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and steps[-1]["rewards/margins"] != 0, name
        assert (out / name / "verify-console.txt").exists()
