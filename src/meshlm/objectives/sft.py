"""--objective sft: the next-token loss, a mean over the global batch's targets."""

from __future__ import annotations

import contextlib
import math

import torch

from meshlm.data.batch import Batch
from meshlm.parallel.loss import next_token_targets, targets_loss_sum, token_loss_sum


class TokenMean:
    """--objective sft: what a step's loss is a mean over (its targets) and each micro-batch's sum. The seam every
    engine computes its loss through (dpo.py's Preference is the other objective)."""

    name = "sft"

    def describe(self, cfg) -> str:
        learned = "the responses only" if cfg.loss_on == "response" else "every token"
        return f"next-token loss (sft) on {learned} (--loss-on {cfg.loss_on}; plain text learns every token)"

    def units(self, batch: Batch) -> torch.Tensor:
        return batch.targets()

    def loss_sum(self, logits: torch.Tensor, batch: Batch, cp=None) -> torch.Tensor:
        """The summed loss of `batch`'s targets; cp (a SequenceSplit): the logits are this cp rank's part."""
        if cp is not None:  # this cp rank's part of each row: its targets
            return targets_loss_sum(logits, cp.local(next_token_targets(batch.labels)))
        return token_loss_sum(logits, batch.labels)

    def prepare(self, engine, batches: list[Batch]) -> None:
        """What a step needs before its forwards (nothing here)."""

    def metrics(self, engine) -> dict:
        """Objective-specific fields of the metrics row, over the steps since the last row (none here)."""
        return {}

    def held_out(self):
        """Around an evaluation: what it tallies stays apart from training's (nothing here)."""
        return contextlib.nullcontext()

    def eval_row(self, loss: float, engine) -> dict:
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}
