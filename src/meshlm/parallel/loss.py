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
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).to(logits.device),
                           ignore_index=IGNORE, reduction="sum")


def global_counts(batches: list[Batch], dp_group, device) -> tuple[int, int]:
    """(targets, padding positions) of the global batch: this rank's, added over the dp ranks in one all-reduce."""
    counts = torch.tensor([sum(b.targets() for b in batches), sum(b.pad_tokens for b in batches)],
                          dtype=torch.float64 if device.type != "mps" else torch.float32, device=device)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    targets, pads = counts.tolist()
    return int(targets), int(pads)


def loss_scale(targets: int, dp_size: int) -> float:
    """What a micro-batch's loss sum is multiplied by before backward (see the module docstring)."""
    return dp_size / max(targets, 1)
