"""--eval-samples in a real 2-rank ZeRO-3 run: every evaluation decodes the first held-out prompts greedily on
both ranks (each forward gathers the sharded weights), and samples.jsonl holds, per evaluated step, exactly what
`meshlm generate --checkpoint` gives from that step's checkpoint."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, meshlm_here, run_meshlm

pytestmark = pytest.mark.slow

TOKENS = 8


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_samples_equal_generate_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    run_meshlm(
        "train",
        *TINY,
        *("--nproc", "2", "--strategy", "zero3", "--micro-batch-size", "4", "--max-steps", "4"),
        *("--eval-every", "2", "--eval-fraction", "0.1", "--ckpt-every", "2"),
        *("--eval-samples", "2", "--eval-sample-tokens", str(TOKENS), "--output-dir", out),
    )
    samples = _rows(out / "samples.jsonl")
    assert [r["step"] for r in samples] == [2, 2, 4, 4]
    log = (out / "logs" / "rank-0.log").read_text()
    for step in (2, 4):
        mine = [r for r in samples if r["step"] == step]
        prompts = tmp_path / f"prompts-{step}.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in mine))
        generated = tmp_path / f"generated-{step}.jsonl"
        ckpt = out / "checkpoints" / f"step-{step}"
        meshlm_here(
            "generate", "--checkpoint", ckpt, "--prompts", prompts, "--max-new-tokens", TOKENS, "--out", generated
        )
        assert [r["completion"] for r in mine] == [r["completion"] for r in _rows(generated)], step
        for i, r in enumerate(mine):
            assert f"step {step}: sample {i}: {r['prompt']!r} -> {r['completion']!r}" in log
