"""--eval-every under --objective grpo: the rewards of the held-out prompts.

Each evaluation decodes one greedy completion of every held-out prompt (the records --eval-fraction holds out, or
--eval-split's, with --grpo.tasks as for training) through the rollout's own decoding (grpo_rollout.py
`Rollout.evaluate`: the training modules, in every layout GRPO trains in), scores them with the run's reward
functions and logs TRL's evaluation names: `eval_reward` (the weighted sum's mean over the prompts),
`eval_rewards/NAME/mean`, `eval_completions/mean_length` and `/clipped_ratio`.

Every data-parallel rank decodes as many prompts (`share`: a rank short of them decodes copies that count for
nothing), so that ranks decoding in lockstep pair every forward (grpo_rollout.py); the rows are gathered in
rank order and each prompt counted once (`eval_row`): the same figures in every layout. Greedy decoding draws from
no generator, so training continues as it would without it.
"""

from __future__ import annotations

import torch

from meshlm.objectives.grpo_loss import weighted_total


def share(n: int, dp: int, rank: int) -> tuple[list[int], list[bool]]:
    """(the prompts data-parallel rank `rank` decodes: every dp-th from its own, then copies of one of them (or
    of prompt 0) up to the largest share; which of them count)."""
    mine = list(range(rank, n, dp))
    short = -(-n // dp) - len(mine)
    return mine + [mine[-1] if mine else 0] * short, [True] * len(mine) + [False] * short


def eval_row(table: torch.Tensor, counted: list[bool], rewards: list) -> dict:
    """The held-out figures from the gathered [completions, functions + 2] table (each function's reward, NaN for
    None; length; clipped), the rows that do not count (the shares' copies) left out."""
    t, F = table[torch.tensor(counted, dtype=torch.bool)], len(rewards)
    row = {"eval_reward": weighted_total(t, [r.weight for r in rewards]).mean().item()}
    for k, r in enumerate(rewards):
        row[f"eval_rewards/{r.name}/mean"] = torch.nanmean(t[:, k]).item()
    row["eval_completions/mean_length"] = t[:, F].mean().item()
    row["eval_completions/clipped_ratio"] = t[:, F + 1].mean().item()
    return row
