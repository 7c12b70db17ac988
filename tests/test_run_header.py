"""The run header (train/header.py) on real tiny runs: what the run is about to do, in the order users read it, and
logs/rank-0.log's line per logged step."""

from __future__ import annotations

import re

import pytest

from conftest import TINY, run_meshlm, without_arch

pytestmark = pytest.mark.slow

# the header's lines open with these, in this order
ORDER = ("model:", "layout:", "objective:", "LoRA:", "data:", "global batch")


def header(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("model:"))
    return lines[start : start + len(ORDER)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with the byte tokenizer, 128 positions (the built-in preference pairs' blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshlm.data.builtin import byte_tokenizer

    path = tmp_path_factory.mktemp("header") / "model"
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_dpo_lora_tensor_parallel_header(model_dir, tmp_path):
    """DPO with LoRA under tensor parallel 2 on 2 ranks from a model directory, with a held-out split."""
    out = tmp_path / "run"
    p = run_meshlm(
        "train", *without_arch(TINY), "--seq-length", "128", "--nproc", "2", "--parallel.tp", "2", "--objective", "dpo",
        "--dpo.beta", "0.25", "--lora.r", "4", "--lora.targets", "q_proj,v_proj", "--model-name", model_dir,
        "--pretrained", "true", "--lr", "1e-4", "--eval-fraction", "0.1", "--max-steps", "2", "--output-dir", out,
    )  # fmt: skip
    lines = header(p.stdout)
    assert [next(k for k in ORDER if line.startswith(k)) for line in lines] == list(ORDER), p.stdout
    model, layout, objective, adapters, data, batch = lines
    assert f"weights from {model_dir}" in model and "random" not in model
    assert layout.startswith("layout: tensor parallel 2 on 2 ranks") and "data parallel" not in layout, layout
    assert (
        "DPO (sigmoid loss), beta 0.25" in objective and "reference: the base model with the adapters off" in objective
    )
    # rank 4 on 2 layers' q_proj (64 -> 64) and v_proj (64 -> 2 kv heads x 16): 2 x 4 x (128 + 96)
    assert re.search(r"rank 4, .*targets q_proj,v_proj; trainable 1,792 of [\d,]+ parameters", adapters), adapters
    assert adapters.endswith("; frozen base fp32"), adapters  # fp32 compute keeps an fp32 base
    assert re.search(r"held out: \d+ documents, [1-9]\d* blocks", data), data
    assert batch.startswith("global batch 8 = ") and "lr 0.0001" in batch
    assert "note: --pretrained" not in p.stdout  # an lr was chosen
    steps = [line for line in (out / "logs" / "rank-0.log").read_text().splitlines() if " INFO step " in line]
    assert len(steps) == 2 and all(re.search(r"step \d: loss [\d.]+, tok_s [\d,]+, acc [\d.]+$", s) for s in steps)


def test_sft_header_opens_the_console_and_notes_the_from_scratch_lr(model_dir, tmp_path):
    """A plain fine-tune in one process: the console opens with the header (no internal detail first); the
    default learning rate with --pretrained gets its note; without --pretrained the header says random."""
    out = tmp_path / "run"
    args = ["train", *without_arch(TINY), "--model-name", model_dir, "--max-steps", "1", "--output-dir", out]
    p = run_meshlm(*args, "--pretrained", "true")
    before = p.stdout.split("\nmodel:")[0].splitlines() if not p.stdout.startswith("model:") else []
    assert all(line.startswith("tokenising") for line in before), p.stdout  # nothing internal before the header
    assert "layout: one process, no parallelism" in p.stdout and "objective: next-token loss (sft)" in p.stdout
    assert "LoRA: off" in p.stdout and "held out: none" in p.stdout
    assert "note: --pretrained fine-tunes at --lr 0.003" in p.stdout
    p = run_meshlm(*args, "--overwrite", "true")
    assert "random initialisation (--seed 1234; add --pretrained to load its weights)" in header(p.stdout)[0]
    assert "note: --pretrained" not in p.stdout
