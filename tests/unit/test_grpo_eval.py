"""GRPO's held-out figures (objectives/grpo_eval.py): each data-parallel rank's equal share of the held-out prompts
(copies that count for nothing where it is short), and the row made from the gathered rewards: the weighted sum's
mean over the prompts counted once, each function's mean ignoring None, the completions' length and clipped share."""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.objectives.grpo_eval import eval_row, share
from meshlm.objectives.grpo_rewards import Reward


def test_every_prompt_once_in_equal_shares():
    for n, dp in ((3, 2), (4, 2), (1, 4), (7, 3), (5, 1)):
        shares = [share(n, dp, rank) for rank in range(dp)]
        assert len({len(ids) for ids, _ in shares}) == 1  # FSDP's lockstep: as many decodes on every rank
        counted = sorted(i for ids, keep in shares for i, k in zip(ids, keep) if k)
        assert counted == list(range(n)), (n, dp)
    assert share(3, 2, 1) == ([1, 1], [True, False])  # rank 1 is short: a copy of its own prompt
    assert share(1, 2, 1) == ([0], [False])  # nothing of its own: a copy of prompt 0


def test_the_row_counts_each_prompt_once():
    rewards = [Reward("exact_match", None, 1.0), Reward("format", None, 0.5)]
    nan = math.nan
    # rank 0: prompts 0, 2; rank 1: prompt 1 and a copy of it (rewards, then length and clipped)
    table = torch.tensor(
        [[1.0, 1.0, 3, 0], [0.0, nan, 6, 1], [1.0, 0.0, 2, 0], [1.0, 0.0, 2, 0]],
        dtype=torch.float64,
    )
    row = eval_row(table, [True, True, True, False], rewards)
    assert row == pytest.approx(
        {
            "eval_reward": (1.5 + 0.0 + 1.0) / 3,  # a None counts 0 in the weighted sum, as in training
            "eval_rewards/exact_match/mean": 2 / 3,
            "eval_rewards/format/mean": 0.5,  # the None left out
            "eval_completions/mean_length": 11 / 3,
            "eval_completions/clipped_ratio": 1 / 3,
        }
    )
