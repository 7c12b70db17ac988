"""Token-exact loss: the sum of every target token's loss over the global batch, divided by their number.

A mean of per-micro-batch means equals the token mean only when every micro-batch holds
the same number of targets; masked prompts and packed documents break that. So the
step first counts the global targets (one scalar all-reduce over the data-parallel
ranks, before any backward), and every micro-batch backpropagates sum / count. DDP and
FSDP average gradients over the dp ranks; the loss is multiplied by dp_size to undo
that, so the gradients are exactly those of the global token mean.
"""

from __future__ import annotations

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


def global_counts(batches: list[Batch], dp_group, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, padding positions) of the global batch: this rank's, added over the dp ranks in one all-reduce.
    Tensors on `device`: the step needs no host sync for them."""
    counts = torch.stack(
        [sum(b.targets().to(device) for b in batches), torch.tensor(sum(b.pad_tokens for b in batches), device=device)]
    )  # int64: exact
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    return counts[0], counts[1]


def loss_scale(targets: torch.Tensor, dp_size: int) -> torch.Tensor:
    """What a micro-batch's loss sum is multiplied by before backward (see the module docstring)."""
    return dp_size / targets.clamp(min=1)
