"""`meshlm report`: what it prints (the run's outcome in words) and tokens_per_s.png's two curves kept apart."""

from __future__ import annotations

import json

import pytest

from meshlm import report as report_mod
from meshlm.cli import main

pytest.importorskip("matplotlib")

# tokens/s and MFU as a run logs them: MFU is tokens/s times a constant
ROWS = [
    {"step": 1, "loss": 5.5, "tokens_per_s": 1000.0, "mfu": 0.010, "mem_peak_bytes": 2**20},
    {"step": 2, "loss": 4.25, "tokens_per_s": 3000.0, "mfu": 0.030, "eval_loss": 4.5, "mem_peak_bytes": 2**20},
    {"step": 3, "loss": 3.75, "tokens_per_s": 2000.0, "mfu": 0.020, "eval_loss": 4.75, "mem_peak_bytes": 2**20},
]


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return tmp_path


def test_report_prints_the_final_loss_and_the_best_held_out_loss(run_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", str(run_dir)])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "final: step 3, loss 3.7500 (first logged: 5.5000 at step 1), 2,000 tokens/s, MFU 2.0%"
    assert lines[1] == "best held-out: eval_loss 4.5000 at step 2 (last: 4.7500 at step 3)"
    assert [line.rsplit("/", 1)[-1] for line in lines[2:]] == ["loss.png", "tokens_per_s.png", "memory.png"]


def test_a_run_without_evaluation_says_so():
    rows = [{k: v for k, v in r.items() if k != "eval_loss"} for r in ROWS]
    assert report_mod.summary(rows)[1].startswith("best held-out: none evaluated")


def test_tokens_per_s_and_mfu_are_drawn_apart(run_dir, monkeypatch):
    """Each curve on its own panel: on two scaled axes over one panel the proportional curves coincide."""
    drawn = {}
    save = report_mod._save

    def record(fig, path, metadata=None):
        fig.canvas.draw()
        drawn[path.name] = [
            (ax.get_window_extent(), [list(line.get_ydata()) for line in ax.get_lines()]) for ax in fig.axes
        ]
        return save(fig, path, metadata)

    monkeypatch.setattr(report_mod, "_save", record)
    report_mod.report(run_dir)
    panels = {tuple(lines[0]): box for box, lines in drawn["tokens_per_s.png"] if lines}
    tokens, mfu = panels[(1000.0, 3000.0, 2000.0)], panels[(1.0, 3.0, 2.0)]
    assert not tokens.overlaps(mfu), (tokens, mfu)


GRPO_ROWS = [
    {
        "step": 1,
        "loss": 0.01,
        "tokens_per_s": 500.0,
        "reward": 0.25,
        "reward_std": 0.5,
        "rewards/exact_match/mean": 0.25,
    }
    | {"completions/mean_length": 9.5, "completions/min_length": 2, "completions/max_length": 16}
    | {"completions/clipped_ratio": 0.125, "mem_peak_bytes": 2**20},
    {
        "step": 2,
        "loss": -0.02,
        "tokens_per_s": 600.0,
        "reward": 0.75,
        "reward_std": 0.25,
        "rewards/exact_match/mean": 0.75,
    }
    | {"completions/mean_length": 6.5, "completions/min_length": 3, "completions/max_length": 8}
    | {"completions/clipped_ratio": 0.0, "mem_peak_bytes": 2**20, "eval_reward": 0.5},
]


def test_a_grpo_run_plots_its_reward_and_completion_length(tmp_path, capsys, monkeypatch):
    """reward.png: the reward (and each function's) above the completions' length; the summary's GRPO line."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GRPO_ROWS))
    drawn = {}
    save = report_mod._save

    def record(fig, path, metadata=None):
        drawn[path.name] = [[list(line.get_ydata()) for line in ax.get_lines()] for ax in fig.axes]
        return save(fig, path, metadata)

    monkeypatch.setattr(report_mod, "_save", record)
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path)])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "best held-out: eval_reward 0.5000 at step 2 (last: 0.5000 at step 2)"
    assert lines[2] == (
        "GRPO: reward 0.750 (first logged: 0.250 at step 1), reward_std 0.250, completions 6.5 tokens on average "
        "(0% clipped)"
    )
    assert [line.rsplit("/", 1)[-1] for line in lines[3:]] == [
        "loss.png",
        "reward.png",
        "tokens_per_s.png",
        "memory.png",
    ]
    png = tmp_path / "plots" / "reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rewards, lengths = drawn["reward.png"]
    assert rewards == [[0.25, 0.75], [0.25, 0.75], [0.5]]  # reward, rewards/exact_match/mean, eval_reward
    assert lengths == [[9.5, 6.5]]
