"""The DPO loss on packed pairs: sequence log-probabilities per document, then one loss per pair.

A block holds whole pairs, each as two documents, prompt + chosen then prompt + rejected (data/preference.py);
position ids restart at every document. So a target's document is the count of restarts up to it, its
pair that count halved, and a pair never leaves its row: whatever splits a batch by rows (data-parallel
ranks, accumulation, pipeline micro-batches) keeps chosen and rejected together. Context parallel splits the
rows' tokens instead: each cp rank sums its own targets' log-probabilities per document and the sums are added
over the cp group (their gradients too: every cp rank computes the same loss from them, 1/C of it each).

Per pair (TRL's DPOTrainer, with Delta = (chosen log-ratio) - (rejected log-ratio) against the reference):
  sigmoid       -(1 - e) log sigmoid(beta Delta) - e log sigmoid(-beta Delta)   (e: label smoothing, cDPO)
  sigmoid_norm  the same on log-ratios divided by their response's length
  ipo           (Delta_norm - 1 / (2 beta))^2, log-ratios divided by their response's length
The rewards are beta x the log-ratios (not divided by length), as TRL logs them. Sums over pairs here; the
engine divides by the global number of pairs (the token-exact rule of engines/base.py, with pairs for targets).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor

from meshlm.data.batch import IGNORE
from meshlm.parallel.loss import next_token_targets

# What dpo.py adds up over a step for the metrics row, in this order (sums over pairs).
STATS = (
    "pairs",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def documents(positions: torch.Tensor) -> torch.Tensor:
    """Each position's document within its row: 0, 1, 2, ... (position ids restart at every document)."""
    return (positions == 0).long().cumsum(dim=1) - 1


def _slots(seq: int) -> int:
    return seq + seq % 2  # documents per row, at most: an even number, so they pair up


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, cp=None) -> torch.Tensor:
    """[rows, pairs, 2, 2]: per pair (chosen, rejected), the summed log-probability of the document's targets
    and their number. Slots past a row's last pair hold zeros. Vocabulary-sharded logits (tensor parallel's
    loss_parallel) give the same numbers. `cp` (a SequenceSplit): the logits are this cp rank's part of each
    row; the sums are added over its group (their gradient summed back: see the module docstring)."""
    rows, seq = labels.shape
    targets = next_token_targets(labels.to(positions.device))  # aligned with the positions that predict them
    doc = F.pad(documents(positions)[:, 1:], (0, 1))  # a target's document: never the first token of its own
    if cp is not None:
        targets, doc = cp.local(targets), cp.local(doc)
    per_token = -F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="none"
    )
    per_token = per_token.full_tensor() if isinstance(per_token, DTensor) else per_token
    sums = per_token.new_zeros(rows, _slots(seq)).scatter_add(1, doc, per_token.view(rows, -1))
    counts = sums.new_zeros(rows, _slots(seq)).scatter_add(1, doc, (targets != IGNORE).to(sums.dtype))
    out = torch.stack([sums, counts], dim=-1).view(rows, -1, 2, 2)
    return out if cp is None else all_reduce(out, group=cp.group)


def pair_counts(labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows]: how many pairs each row holds (documents with targets, halved; no host sync)."""
    rows, seq = labels.shape
    doc = documents(positions)[:, 1:]
    learned = (labels[:, 1:] != IGNORE).long().to(doc.device)
    per_doc = torch.zeros(rows, _slots(seq), dtype=torch.long, device=doc.device).scatter_add(1, doc, learned)
    return (per_doc > 0).sum(dim=1) // 2


def pairs(labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """How many pairs the rows hold (a 0-dim tensor)."""
    return pair_counts(labels, positions).sum()


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, loss: str, beta: float, smoothing: float):
    """(per-pair loss [rows, pairs], the STATS summed over the real pairs) from the policy's sequence_logps and
    the reference's log-probabilities ([rows, pairs, 2]). Empty slots (no targets) give a zero loss and count
    nowhere."""
    logps, tokens = policy[..., 0], policy[..., 1]
    ratios = logps - reference
    real = tokens[..., 0] > 0
    if loss == "sigmoid":
        delta = ratios[..., 0] - ratios[..., 1]
    else:  # ipo, sigmoid_norm: per-token log-ratios
        per_token = ratios / tokens.clamp(min=1)
        delta = per_token[..., 0] - per_token[..., 1]
    if loss == "ipo":
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(-beta * delta)
    losses = torch.where(real, losses, torch.zeros_like(losses))
    rewards = beta * ratios.detach()
    chosen, rejected = rewards[..., 0], rewards[..., 1]
    stats = torch.stack(
        [
            torch.ones_like(chosen),
            chosen,
            rejected,
            (chosen > rejected).to(chosen.dtype),
            chosen - rejected,
            logps[..., 0].detach(),
            logps[..., 1].detach(),
        ]
    )
    return losses, torch.where(real, stats, torch.zeros_like(stats)).sum(dim=(1, 2))
