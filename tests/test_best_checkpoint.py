"""--keep-best and --early-stopping-patience in a real run (in this process, one rank): checkpoints/best names
the complete checkpoint of the lowest eval_loss, survives --keep-last, is kept across a resume, and evaluations
that stop improving end training after the patience."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, meshlm_here, metrics

# The learning rate decays to 0 at step 6 and stays there (a resumed run keeps its schedule): from then on no
# weight moves, so no evaluation after step 6 can be lower than the best.
ARGS = [
    *TINY,
    *("--micro-batch-size", "4", "--eval-every", "2", "--eval-fraction", "0.1", "--keep-best"),
    *("--lr-schedule-steps", "6", "--min-lr-ratio", "0"),
]


def test_best_checkpoint_and_early_stopping(tmp_path):
    out = tmp_path / "run"
    meshlm_here("train", *ARGS, "--max-steps", "6", "--output-dir", out)
    evals = {row["step"]: row["eval_loss"] for row in metrics(out) if "eval_loss" in row}
    best_step = min(evals, key=evals.get)
    ckpts = out / "checkpoints"
    assert (ckpts / "best").read_text() == f"step-{best_step}\n"
    assert (ckpts / f"step-{best_step}" / "COMPLETE").is_file()
    saved = json.loads((ckpts / f"step-{best_step}" / "trainer.json").read_text())["state"]
    assert saved["best_eval_loss"] == pytest.approx(evals[best_step]) and saved["best_step"] == best_step

    meshlm_here(
        "train",
        *ARGS,
        "--max-steps",
        "20",
        "--early-stopping-patience",
        "2",
        "--keep-last",
        "1",
        "--output-dir",
        out,
    )
    steps = [row["step"] for row in metrics(out)]
    assert steps[-1] == 10, steps  # evaluations at 8 and 10 did not improve: stopped after the second
    assert (ckpts / "latest").read_text() == "step-10\n"
    assert (ckpts / "best").read_text() == f"step-{best_step}\n"
    assert sorted(p.name for p in ckpts.glob("step-*")) == sorted({f"step-{best_step}", "step-10"})
