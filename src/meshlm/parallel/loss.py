"""Token-exact loss: the sum of every target token's loss over the global batch, divided by their number.

A mean of per-micro-batch means equals the token mean only when every micro-batch holds
the same number of targets; masked prompts and packed documents break that. So the
step first counts the global targets (one scalar all-reduce over the data-parallel
ranks, before any backward), and every micro-batch backpropagates sum / count. DDP and
FSDP average gradients over the dp ranks; the loss is multiplied by dp_size to undo
that, so the gradients are exactly those of the global token mean.

The same rule holds for any objective whose loss is a mean over units (`TokenMean` here: targets; DPO: pairs):
count the global units first, then every micro-batch backpropagates its sum x dp / count.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.data.batch import IGNORE, Batch


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies of every target (logits[:, i] predicts labels[:, i + 1]), in fp32."""
    logits = logits[:, :-1].float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1).to(logits.device),
        ignore_index=IGNORE,
        reduction="sum",
    )


class TokenMean:
    """--objective sft: what a step's loss is a mean over (its targets) and each micro-batch's sum. The seam every
    engine computes its loss through (train/dpo.py's Preference is the other objective)."""

    name = "sft"

    def units(self, batch: Batch) -> torch.Tensor:
        return batch.targets()

    def loss_sum(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
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


def global_counts(batches: list[Batch], units, dp_group, device) -> tuple[torch.Tensor, ...]:
    """(targets, padding positions, units the loss is a mean over) of the global batch: this rank's, added over the
    dp ranks in one all-reduce. Tensors on `device`: the step needs no host sync for them."""
    counts = torch.stack(
        [
            sum(b.targets().to(device) for b in batches),
            torch.tensor(sum(b.pad_tokens for b in batches), device=device),
            sum(units(b).to(device) for b in batches),
        ]
    )  # int64: exact
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    return counts[0], counts[1], counts[2]


def loss_scale(units: torch.Tensor, dp_size: int) -> torch.Tensor:
    """What a micro-batch's loss sum is multiplied by before backward (see the module docstring)."""
    return dp_size / units.clamp(min=1)
