"""`meshlm plan` in real processes: bad input from the console script, and one multi-rank `--validate` run that
compares the plan with what the ranks measured (the arithmetic is tests/unit/test_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_meshlm

pytestmark = pytest.mark.slow

TINY_DIMS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--mlp", "128"]


def _drawn(png) -> dict:
    """The numbers plot_memory_bars drew, from the PNG's Description text chunk."""
    from PIL import Image

    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    return json.loads(Image.open(png).text["Description"])


def held_bytes(run: Path, layout: str) -> dict[int, int]:
    """Each rank's parameter, gradient and AdamW bytes, counted from transformers' model of the run's config (on
    the meta device): 16 bytes per element held (fp32 parameter, gradient and two moments; bf16 autocast keeps
    the parameters fp32). single and ddp hold every tensor; pp2's stage 0 the embedding and block 0, stage 1
    block 1, the final norm and the head; tp2 half of every matrix (Megatron's column and row shards, the
    vocabulary-parallel embedding and head) and all of every vector (the norms), and the embedding's gradient
    whole."""
    from transformers import AutoModelForCausalLM

    from meshlm import config as config_mod
    from meshlm.models.build import load_tokenizer, model_config

    cfg = config_mod.load(str(run / "config.toml"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(cfg, len(load_tokenizer(cfg)[0])))
    params = dict(model.named_parameters())
    assert cfg.arch.layers == 2 and not model.config.tie_word_embeddings
    if layout == "tp2":
        held = 16 * sum(p.numel() // (2 if p.ndim == 2 else 1) for p in params.values())
        embedding = params["model.embed_tokens.weight"].numel()
        # DTensor's embedding backward returns the gradient replicated: the whole vocabulary's, fp32 (docs/plan.md)
        return dict.fromkeys((0, 1), held + 4 * (embedding - embedding // 2))
    if layout == "pp2":
        stage1 = ("model.layers.1.", "model.norm.", "lm_head.")
        return {r: 16 * sum(p.numel() for n, p in params.items() if n.startswith(stage1) == r) for r in (0, 1)}
    ranks = (0,) if layout == "single" else (0, 1)
    return dict.fromkeys(ranks, 16 * sum(p.numel() for p in params.values()))


def test_bad_input_in_a_real_process():
    p = run_meshlm("plan", "--gpu-memory", "eighty", check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "meshlm: error: --gpu-memory: cannot read 'eighty' as a size; use e.g. 80GiB, 80GB or 80e9"
    ]


def test_validate_against_real_runs(tmp_path):
    """single on 1 rank; ddp, pp2, tp2 and ddp cp2 on 2 gloo ranks through the real trainer; every rank's measurement
    within target: model states 3%, communication payload per collective 5%, peak activations 20% (bf16
    autocast: the model includes autocast's cached bf16 weights)."""
    out = tmp_path / "v"
    p = run_meshlm(
        "plan",
        "--validate",
        "--nproc",
        "2",
        "--strategy",
        "single,ddp",
        "--precision",
        "bf16",
        "--micro-batch-size",
        "4",
        *TINY_DIMS,
        "--json",
        "--output-dir",
        out,
        "--plot",
    )
    data = json.loads(p.stdout)
    results = {r["layout"]: r for r in data["results"]}
    assert set(results) == {"single", "ddp", "pp2", "tp2", "ddp cp2"}  # --strategy ddp: with its pp, tp and cp mixes
    drawn = _drawn(data["plot"])  # --plot: each layout's prediction with what its fullest rank measured beside it
    assert data["plot"] == str(out / "plan-memory.png") and sorted(drawn["layouts"]) == sorted(results)
    for r in results.values():
        rows = {row["quantity"]: row for row in r["rows"]}
        assert all(row["ok"] for row in rows.values()), rows
        run = out / r["layout"].replace(" ", "_")  # "ddp cp2" runs in ddp_cp2
        probes = [json.loads(f.read_text()) for f in run.glob("probe/rank-*.json")]
        # what each rank measured against a count of the tensors it holds, made from transformers' own model
        held = held_bytes(run, r["layout"])
        assert {m["rank"]: m["model_state_bytes"] for m in probes} == held, r["layout"]
        assert r["metrics_model_state_bytes"] == held[0] and rows["model states"]["measured"] in held.values()
        assert drawn["measured"][r["layout"]] == max(
            m["model_state_bytes"] + m["activation_peak_bytes"] for m in probes
        )
    ddp = {row["quantity"]: row for row in results["ddp"]["rows"]}
    # fp32 gradients, once, and the step's global target and padding counts (two int64, engines/base.py), beside
    # scalar collectives the plan leaves out (8 bytes when measured), at most 1 KiB (docs/plan.md)
    extra = ddp["comm all_reduce"]["measured"] - (ddp["model states"]["measured"] // 4 + 16)
    assert 0 <= extra <= 1024, extra
    assert len(list(out.glob("ddp/probe/rank-*.json"))) == 2
    # Megatron's count: 2 all-reduces forward (bf16 outputs) + 2 backward (fp32 residual-stream gradients) per
    # block, 2 blocks, 8 x 64 tokens of width 64 per rank; a few bytes more for the logged loss and grad norm
    tp = {row["quantity"]: row for row in results["tp2"]["rows"]}
    # embedding output and head input grad per token; loss_parallel's 3 per predicting position (63 of 64)
    vocab_parallel = 8 * 64 * (64 * 4 + 64 * 4) + 8 * 63 * 12
    assert 0 <= tp["comm all_reduce"]["measured"] - 2 * 8 * 64 * 64 * (2 * 2 + 2 * 4) - vocab_parallel <= 1024
    assert "comm all_gather/broadcast" not in tp  # embedding and LM head replicated: no logits gather
    pp = {row["quantity"]: row for row in results["pp2"]["rows"]}
    # 2 micro-batches of 4 sequences x 64 tokens x width 64 in fp32, activations forward and gradients backward
    assert pp["comm p2p"]["measured"] == 2 * 2 * (4 * 64 * 64 * 4)
    cp = {row["quantity"]: row for row in results["ddp cp2"]["rows"]}
    # ulysses (4 heads, 2 kv heads of 16 over 2 ranks), 2 micro-batches x 2 blocks, 4 sequences of 32 local tokens:
    # q and k fp32 (rotary's cos and sin are), v and the attention output bf16; forward and backward
    assert cp["comm all_to_all"]["measured"] == 2 * 2 * 2 * 4 * 32 * ((64 + 32) * 4 + (32 + 64) * 2)
    # the whole sequence's int64 position ids, once per micro-batch, beside the ddp's parameter broadcast
    assert cp["comm all_gather/broadcast"]["measured"] == 2 * 4 * 64 * 8 + ddp["comm all_gather/broadcast"]["measured"]


def _validated(*args: str) -> tuple[dict, dict]:
    """`meshlm plan --validate --nproc 2` at its defaults (the built-in tiny model, seq 64, micro-batch 1, bf16),
    narrowed by ARGS: its results by layout, and what it skipped."""
    p = run_meshlm("plan", "--validate", "--nproc", "2", "--tp", "1", "--pp", "1", *args, "--json")
    data = json.loads(p.stdout)
    return {r["layout"]: r for r in data["results"]}, data["skipped"]


def test_validate_passes_every_zero_row_at_its_defaults():
    """The rows `plan --validate --nproc 2` runs at its defaults that the test above and
    tests/test_plan_simulate_real.py (zero1, zero3) leave out: bf16 zero2 (fp32 master weights per owner), and
    zero1, zero2 and zero3 under context parallel 2, whose one data-parallel rank accumulates the global batch of
    2 over 2 micro-batches. zero2 keeps whole gradients from the first micro-batch's backward to the last one's
    reduce-scatter, a buffer the step frees beside the activations: the probe counts it in the activation peak."""
    results, skipped = _validated("--strategy", "zero1,zero2,zero3", "--cp", "2")
    assert set(results) == {"zero1 cp2", "zero2 cp2", "zero3 cp2"} and set(skipped) == {"zero3 cp2 +offload"}
    plain, _ = _validated("--strategy", "zero2", "--cp", "1")
    results.update(plain)
    for name, r in results.items():
        assert r["ok"] and all(row["ok"] for row in r["rows"]), (name, r["rows"])
        accumulation = r["command"][r["command"].index("--grad-accum") + 1]
        assert accumulation == ("1" if name == "zero2" else "2"), name
    rows = {row["quantity"]: row for row in results["zero2 cp2"]["rows"]}
    # the whole fp32 gradients, reduce-scattered once per step, are part of the measured peak
    assert rows["activation peak"]["measured"] > rows["comm reduce_scatter/reduce"]["measured"]
