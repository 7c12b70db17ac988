"""What must hold on every release in the supported range (meshlm/versions.py), run by `make test-compat` under
another transformers or torch (the Makefile's COMPAT_TESTS): the built-in job's losses equal those
stored from the release meshlm is developed on, zero3 and tp 2 equal one process, an export reloads in
transformers with the trained logits, and greedy generate gives transformers' own tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TINY, assert_close, losses, meshlm_here, run_cases, run_meshlm

pytestmark = pytest.mark.slow

STEPS = ["--max-steps", "5", "--micro-batch-size", "8", "--dropout-off", "true"]
# The built-in job at TINY's size, one process, 5 steps: its losses on torch 2.13.0 and transformers 5.24.0. The
# same arithmetic on every release, so equal to float32 rounding.
REFERENCE = [5.781740188598633, 5.618354797363281, 5.45057487487793, 5.207228660583496, 5.0363311767578125]
PROMPTS = ["Reverse: abc", "2+3="]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("range") / "single"
    run_meshlm("train", *TINY, *STEPS, "--strategy", "single", "--save-final", "true", "--output-dir", out)
    return out


def test_builtin_job_losses_equal_the_stored_reference(single):
    assert_close(losses(single), REFERENCE, rtol=1e-6)


def test_zero3_and_tp2_equal_one_process(single, tmp_path):
    # zero3: two data-parallel ranks of 4 rows each, the one process's batch of 8; tp 2: one rank's batch
    layouts = {"zero3": ["--strategy", "zero3", "--micro-batch-size", "4"], "tp": ["--parallel.tp", "2"]}
    cases = [
        {"id": name, "kind": "train", "args": [*TINY, *STEPS, *extra, "--output-dir", str(tmp_path / name)]}
        for name, extra in layouts.items()
    ]
    results = run_cases(2, cases, tmp_path / "launch")
    assert_close(results["zero3"]["losses"], losses(single), rtol=1e-5)
    assert_close(results["tp"]["losses"], losses(single), rtol=1e-4)


def test_export_reloads_and_generate_gives_transformers_greedy_tokens(single, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported, prompts = tmp_path / "export", tmp_path / "prompts.txt"
    meshlm_here("export", "--checkpoint", single, "--out", exported)  # in this process: no ranks to start
    prompts.write_text("".join(p + "\n" for p in PROMPTS))
    out = tmp_path / "generated.jsonl"
    args = ("--prompts", prompts, "--out", out, "--max-new-tokens", "8", "--greedy")
    meshlm_here("generate", "--checkpoint", single, *args)  # meshlm's checkpoint; transformers reloads the export
    model, tokenizer = AutoModelForCausalLM.from_pretrained(exported).eval(), AutoTokenizer.from_pretrained(exported)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for prompt, record in zip(PROMPTS, records, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert record["completion"] == tokenizer.decode(theirs[0, ids.shape[1] :], skip_special_tokens=True), record
