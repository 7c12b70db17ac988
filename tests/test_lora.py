"""LoRA (parallel/lora.py) under real multi-rank layouts: parity with single-process LoRA, resume of an
adapters-only checkpoint under other layouts, export (merged and adapter-only), one-line errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import TINY, assert_close, losses, metrics, run_meshlm, tree_digest

pytestmark = pytest.mark.slow

RTOL = 1e-5  # fp32 losses, as tests/test_sharded.py
LORA = [*TINY, "--lora.r", "8", "--max-steps", "3", "--ckpt-every", "2"]
LAYOUTS = {  # global batch 8 everywhere
    "single": [],
    "zero3": ["--nproc", "4", "--strategy", "zero3", "--micro-batch-size", "2"],
}  # pp, hsdp, zero1/2, fsdp+tp, layer-split: `meshlm verify --lora.r 8` and docs/lora.md (suite time budget)
RESUMED = {
    "ddp": ["--nproc", "2", "--strategy", "ddp", "--micro-batch-size", "4"],
    "tp": ["--nproc", "2", "--parallel.tp", "2"],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Runs shared by the tests below: single, zero3 on 4 ranks, and zero3's step-2 checkpoint resumed
    under ddp on 2 ranks and under tp 2."""
    root = tmp_path_factory.mktemp("lora")
    for name, args in LAYOUTS.items():
        run_meshlm("train", *LORA, *args, "--output-dir", root / name)
    for name, args in RESUMED.items():
        ckpts = root / f"resumed-{name}" / "checkpoints"
        shutil.copytree(root / "zero3" / "checkpoints" / "step-2", ckpts / "step-2")
        (ckpts / "latest").write_text("step-2\n")
        run_meshlm("train", *LORA, *args, "--output-dir", root / f"resumed-{name}")
    return root


def adapters(run) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run / "final.pt"
    dcp_to_torch_save(run / "checkpoints" / "step-3" / "state", out)
    return torch.load(out, weights_only=False)["model"]


@pytest.mark.parametrize("name", ["zero3"])
def test_layout_matches_single(root, name):
    assert_close(losses(root / name), losses(root / "single"), RTOL)
    want, got = adapters(root / "single"), adapters(root / name)
    assert set(got) == set(want) and all(".lora_" in k for k in want)  # adapters only: no base weight saved
    # AdamW divides each gradient by its own running size, so summation-order noise in a near-zero gradient is
    # amplified in its adapter entry: one of 512 differed by 1.7e-6 (values ~2e-3) with the base's seeds of
    # models/materialize.py base_name; losses stay within RTOL.
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(RESUMED))
def test_zero3_checkpoint_resumes_under_another_layout(root, name):
    assert_close(losses(root / f"resumed-{name}"), losses(root / "single")[2:], RTOL)


def test_export_merged_and_adapter_give_the_trained_logits(root, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshlm import config as config_mod
    from meshlm.models.build import build_model, load_tokenizer
    from meshlm.models.materialize import InitialWeights, materialize
    from meshlm.parallel.lora import apply_lora

    run_meshlm("export", "--checkpoint", root / "zero3", "--out", tmp_path / "merged")
    run_meshlm("export", "--checkpoint", root / "zero3", "--out", tmp_path / "adapter", "--adapter-only")
    cfg = config_mod.load(str(root / "zero3" / "config.toml"))
    tok, _ = load_tokenizer(cfg)

    def base():  # the built-in base as training built it: on meta, then the name-seeded init
        model = build_model(cfg, tok, "meta")
        materialize(model, InitialWeights.of(model, cfg.seed), "cpu")
        return model.eval()

    trained = apply_lora(base(), cfg)  # the trained model: base + the checkpoint's adapters
    trained.load_state_dict(adapters(root / "zero3"), strict=False)
    ids = torch.randint(0, 250, (2, 16))
    with torch.no_grad():
        want = trained(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
        adapted = PeftModel.from_pretrained(base(), tmp_path / "adapter").eval()(ids).logits
    assert not torch.allclose(want, base()(ids).logits, atol=1e-4)  # the adapters changed the model
    for got in (merged, adapted):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--lora.targets", "q_proj,nope"], ["nope", "q_proj", "down_proj"]),
        # r larger than a target and --strategy dp: same error path, messages in tests/unit/test_lora_adapters.py
        (["--seed", "7"], ["another model"]),
    ],
)
def test_bad_lora_input_one_line_exit_2_nothing_written(root, tmp_path, args, words):
    run = tmp_path / "run"
    shutil.copytree(root / "single", run)  # resuming this run with bad input must leave it as it is
    before = tree_digest(run)
    p = run_meshlm("train", *LORA, "--max-steps", "4", *args, "--output-dir", run, check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("meshlm: error:"), p.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]
    assert tree_digest(run) == before


@pytest.mark.parametrize("name, strategy, shard", [("single", "single", 1), ("zero3", "zero3", 4)])
def test_model_state_bytes_follow_the_accounting(root, name, strategy, shard):
    """metrics.jsonl's frozen / adapter / gradient / optimizer bytes (rank 0) against plan/memory.py (3%)."""
    from meshlm import config as config_mod
    from meshlm.models.build import load_tokenizer, model_config
    from meshlm.plan.memory import StageShape, lora_states
    from meshlm.plan.spec import from_hf_config

    cfg = config_mod.load(str(root / name / "config.toml"))
    spec = from_hf_config("tiny", model_config(cfg, len(load_tokenizer(cfg)[0])))
    want = lora_states(spec, StageShape(layers=2, first=True, last=True, in_flight=1, tp=1), strategy, shard, 8, 4)
    row = metrics(root / name)[-1]
    got = {
        "frozen parameters": row["frozen_bytes"],
        "adapters": row["adapter_bytes"],
        "gradients": row["grad_bytes"],
        "optimizer": row["optim_bytes"],
    }
    if strategy == "single":  # elsewhere model_state_bytes takes parameters at their peak (mid-step)
        assert sum(got.values()) == row["model_state_bytes"]
    for k, v in want.items():
        assert abs(got[k] - v) <= 0.03 * v, (k, got[k], v)


def test_generate_runs_a_lora_checkpoint_in_tp_and_layer_split_modes(root, tmp_path):
    """tp and layer split merge the adapters per shard (infer/load.py); dp merges the whole model as export."""
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Reverse: abc"}\n{"prompt": "Add 2 and 3"}\n')
    got = {}
    for mode in (["dp"], ["tp", "--nproc", "2"], ["layer-split", "--devices", "cpu,cpu"]):
        out = tmp_path / f"{mode[0]}.jsonl"
        run_meshlm(
            "generate",
            "--checkpoint",
            root / "zero3",
            "--prompts",
            prompts,
            "--out",
            out,
            "--max-new-tokens",
            "6",
            "--mode",
            *mode,
        )
        got[mode[0]] = [json.loads(x)["token_ids"] for x in out.read_text().splitlines()]
    assert len(got["tp"]) == 2 and got["tp"] == got["layer-split"] == got["dp"]


def test_verify_lora_in_every_two_rank_layout(tmp_path):
    """`meshlm verify --lora.r 8` on 2 ranks: the layouts the runs above leave out (layer-split, ddp, zero1,
    zero2, tp, pp) against single-process LoRA: losses and gradient norms at verify's usual tolerances, final
    adapters at its LoRA one (dp's refusal: tests/unit/test_lora_adapters.py)."""
    names = ["layer-split", "ddp", "zero1", "zero2", "tp", "pp-1f1b"]
    p = run_meshlm(
        "verify",
        "tiny",
        "--lora.r",
        "8",
        "--nproc",
        "2",
        "--steps",
        "2",
        "--layouts",
        ",".join(names),
        "--output-dir",
        tmp_path / "verify",
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.split()[:1] and line.split()[0] in names}
    assert sorted(rows) == sorted(names) and all(r.rstrip().endswith("ok") for r in rows.values()), p.stdout
    assert "loss 0.0001 and grad norm 0.001" in p.stdout and "parameters 0.05" in p.stdout
