"""Token-exact loss: the sum of every target token's loss over the global batch, divided by their number.

A mean of per-micro-batch means equals the token mean only when every micro-batch holds
the same number of targets; masked prompts and packed documents break that. So the
step first counts the global targets (one scalar all-reduce over the data-parallel
ranks, before any backward), and every micro-batch backpropagates sum / count. DDP and
FSDP average gradients over the dp ranks; the loss is multiplied by dp_size to undo
that, so the gradients are exactly those of the global token mean.

The same rule holds for any objective whose loss is a mean over units (`TokenMean`, sft.py: targets; DPO: pairs):
count the global units first, then every micro-batch backpropagates its sum x dp / count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshlm.data.batch import Batch


def global_counts(batches: list[Batch], units, dp_group, device) -> tuple[torch.Tensor, ...]:
    """(targets, padding positions, units the loss is a mean over) of the global batch: this rank's, added over the
    dp ranks in one all-reduce, and that all-reduce's work (None without dp ranks): the counts hold the global
    sums once it is waited for. Tensors on `device`: the step needs no host sync for them."""
    counts = torch.stack(
        [
            sum(b.targets().to(device) for b in batches),
            torch.tensor(sum(b.pad_tokens for b in batches), device=device),
            sum(units(b).to(device) for b in batches),
        ]
    )  # int64: exact
    work = dist.all_reduce(counts, group=dp_group, async_op=True) if dp_group is not None else None
    return counts[0], counts[1], counts[2], work


def loss_scale(units: torch.Tensor, dp_size: int) -> torch.Tensor:
    """What a micro-batch's loss sum is multiplied by before backward (see the module docstring)."""
    return dp_size / units.clamp(min=1)
