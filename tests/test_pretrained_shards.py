"""--pretrained read per shard from safetensors: every layout's first-step loss equals the checkpoint's own.

The checkpoint is a Llama saved by the test (save_pretrained), once as one model.safetensors and once
as a sharded model.safetensors.index.json; initializer_range 0.2 makes the logits peaked, so a wrong
slice anywhere (a TP column, a pipeline stage, an FSDP row block) moves the loss far beyond 1e-5.
The first logged loss is taken before any update: it is the loaded model's loss on the first batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import assert_close, losses, run_cases, run_meshlm
from helpers.data import load_blocks
from meshlm import config as config_mod
from meshlm.data.builtin import byte_tokenizer
from meshlm.data.sampler import ResumableSampler
from meshlm.models.build import load_tokenizer
from meshlm.parallel.loss import token_loss_sum

pytestmark = pytest.mark.slow

ARGS = [
    "--seq-length",
    "32",
    "--builtin-samples",
    "64",
    "--loss-on",
    "all",
    "--max-steps",
    "1",
    "--micro-batch-size",
    "4",
    "--progress",
    "false",
    "--log-every",
    "1",
    "--pretrained",
    "true",
    "--save-final",
    "false",
]
LAYOUTS = {
    "tp-2": (2, ["--parallel.tp", "2"], "sharded"),
    "pp-2": (2, ["--parallel.pp", "2", "--parallel.micro-batches", "2"], "single"),
    "zero3-2": (2, ["--strategy", "zero3", "--micro-batch-size", "2"], "sharded"),
    "fsdp-2-tp-2": (4, ["--strategy", "fsdp", "--parallel.tp", "2", "--micro-batch-size", "2"], "single"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("pretrained")
    tok = byte_tokenizer()
    cfg = LlamaConfig(
        vocab_size=(len(tok) + 63) // 64 * 64,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for name, kw in (("single", {}), ("sharded", {"max_shard_size": "60KB"})):
        model.save_pretrained(d / name, **kw)
        tok.save_pretrained(d / name)
    assert len(list((d / "sharded").glob("model-*.safetensors"))) > 4
    return d, model


def first_batch_loss(model, model_dir) -> float:
    cfg = config_mod.load(
        None, [("model_name", str(model_dir)), ("seq_length", "32"), ("builtin_samples", "64"), ("loss_on", "all")]
    )  # every token a target: the weights are what is checked
    tok, tok_id = load_tokenizer(cfg)
    blocks = load_blocks(cfg, tok, tok_id)
    b = blocks.batch(next(iter(ResumableSampler(len(blocks), 1, 0, shuffle=True, seed=cfg.seed, batch_size=4))))
    b = b.to("cpu")
    with torch.no_grad():  # meshlm's loss: the token mean over the targets, documents packed by position ids
        logits = model(input_ids=b.ids, position_ids=b.positions, use_cache=False).logits
        return (token_loss_sum(logits, b.labels) / b.targets()).item()


def test_single_reads_the_checkpoint(checkpoints, tmp_path):
    d, model = checkpoints
    run_meshlm("train", *ARGS, "--model-name", d / "single", "--output-dir", tmp_path / "single")
    assert_close(losses(tmp_path / "single"), [first_batch_loss(model, d / "single")], 1e-5)


@pytest.fixture(scope="module")
def layout_runs(checkpoints, tmp_path_factory) -> Path:
    """Every layout of LAYOUTS, those of one world size in one launch (tests/helpers/family_runs.py: meshlm's trainer
    in the ranks of one job): the directory holding one run directory per layout."""
    d, _ = checkpoints
    root = tmp_path_factory.mktemp("layouts")
    for world in sorted({nproc for nproc, _, _ in LAYOUTS.values()}):
        cases = [
            {
                "id": name,
                "kind": "train",
                "args": [*ARGS, *args, "--model-name", str(d / which), "--output-dir", str(root / name)],
            }
            for name, (nproc, args, which) in LAYOUTS.items()
            if nproc == world
        ]
        run_cases(world, cases, root / "launches")
    return root


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_reads_its_shards(checkpoints, layout_runs, layout):
    d, model = checkpoints
    which = LAYOUTS[layout][2]
    assert_close(losses(layout_runs / layout), [first_batch_loss(model, d / which)], 1e-5)


def test_shape_mismatch_is_one_line_on_every_rank(checkpoints, tmp_path):
    import json
    import shutil

    d, _ = checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(d / "sharded", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 192}))
    p = run_meshlm(
        "train",
        *ARGS,
        "--nproc",
        "2",
        "--parallel.tp",
        "2",
        "--model-name",
        bad,
        "--output-dir",
        tmp_path / "out",
        check=False,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("meshlm: error:")]
    assert len(errors) == 1 and "model.layers.0.mlp.gate_proj.weight in " in errors[0], p.stderr[-2000:]
    assert "has shape [128, 64], but the model config needs [192, 64]" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_single_on_gpu_reads_the_sharded_checkpoint(checkpoints, tmp_path):
    """The per-shard read onto a CUDA device (index of many files): the same first loss as transformers on the CPU."""
    d, model = checkpoints
    p = run_meshlm("train", *ARGS, "--model-name", d / "sharded", "--output-dir", tmp_path / "gpu")
    assert "cuda" in p.stdout + p.stderr, "the run did not say it ran on cuda"
    assert_close(losses(tmp_path / "gpu"), [first_batch_loss(model, d / "sharded")], 1e-5)
