"""The GRPO loss (and its Dr. GRPO, DAPO and BNPO aggregations) on completions, with TRL's GRPOTrainer definitions.

Per completion i of a group of G (the completions of one prompt), with reward r_i:
  advantage  A_i = (r_i - mean of its group) / (std + 1e-4), std (Bessel's, ddof 1) over its group (`group`) or
             over the whole generation batch (`batch`); `none`: not divided. NaN rewards (no reward function scored
             the completion) are left out of the mean and std and get a zero advantage.
Per completion token t, with ratio rho = exp(logp - old logp) (old = this logp detached when each generated batch
is trained on once):
  loss_t     -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta rho k3,
             k3 = exp(ref - logp) - (ref - logp) - 1 (rho k3: TRL's use_bias_correction_kl, its default; k3 without it)
Aggregated over the micro-batch's completion tokens (mask):
  grpo       the mean over completions of each one's token mean
  bnpo       token sum / token count
  dr_grpo    token sum / (completions x max_completion_length)
  dapo       token sum / the generation batch's completion tokens over every process (TRL's num_items_in_batch)
Under meshlm's token-exact rule (engines/base.py) the engine counts the global units first and every micro-batch
backpropagates its sum x dp / units: `loss_sum` and `units` give them. For grpo (units: completions), dr_grpo
(completions x max length) that is TRL's loss whenever TRL's micro-batches hold as many completions each; for dapo
(completion tokens) whenever one optimizer step trains on the whole generation batch (TRL's default: steps per
generation = accumulation steps; with more, TRL divides by that batch's tokens per step on average). bnpo becomes
the global token mean, where TRL averages per-micro-batch token means (a number that depends on the layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshlm.parallel.loss import CHUNK_ELEMENTS

LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALES = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: added to the std before dividing

# What the engine adds up over a step for the metrics row, in this order (sums over completion tokens; means are
# each sum / "tokens", TRL's global masked means).
STATS = ("tokens", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy")


def nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs (TRL's nanstd: NaN where fewer than 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def weighted_total(table: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Each completion's reward from [completions, functions (+ more columns)]: its functions' rewards times
    --grpo.reward-weights, summed (a None, NaN here, counts 0)."""
    w = torch.tensor(weights, dtype=torch.float64)
    return (table[:, : len(weights)].double() * w).nansum(dim=1)


def advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B*G], whether each completion's std is zero [B*G]) from rewards [B*G], each group's completions
    consecutive. The second gives TRL's frac_reward_zero_std as its mean; under `batch` it is the batch's std for
    every completion (all or none zero), as TRL computes it. The whole generation batch's rewards: a group split
    over ranks would be normalised by part of its completions."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards {scale!r}: one of {', '.join(SCALES)}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif group_size > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(group_size)
    else:
        std = torch.zeros_like(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + STD_EPSILON)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def _chunk_logps(hidden, weight, bias, targets, temperature: float):
    logp = (F.linear(hidden, weight, bias).float() / temperature).log_softmax(-1)
    token = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token, entropy.detach()


def token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [B, T] of `targets` [B, T], entropies [B, T], detached) from the hidden states that predict
    them [B, T, H] through the LM head (`weight` [V, H]) at `temperature`, as TRL scores completions. Chunks of
    `chunk` tokens (0: CHUNK_ELEMENTS worth of logits), each checkpointed: one chunk's logits and log-softmax are
    alive at a time, in forward and in backward. Targets past a completion's end may be any id (masked later)."""
    rows, length, width = hidden.shape
    flat, ids = hidden.reshape(-1, width), targets.reshape(-1).clamp(min=0)
    chunk = chunk or max(1, CHUNK_ELEMENTS // weight.shape[0])
    tokens, entropies = [], []
    for a in range(0, flat.shape[0], chunk):
        t, e = checkpoint(
            _chunk_logps, flat[a : a + chunk], weight, bias, ids[a : a + chunk], temperature, use_reentrant=False
        )
        tokens.append(t)
        entropies.append(e)
    return torch.cat(tokens).view(rows, length), torch.cat(entropies).view(rows, length)


def per_token_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    kl_ratio: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss [B, T], per-token statistics [B, T] by name: low/high/region clipped, kl) from the completion tokens'
    log-probabilities [B, T], the completions' advantages [B] and the old and reference log-probabilities.
    `kl_ratio` (TRL's use_bias_correction_kl, on by default since TRL 1.x): the KL term is multiplied by the
    ratio, which changes its gradient even on-policy, where the ratio is 1 but differentiable."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    low = ((ratio < 1 - epsilon) & (adv < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).float()
    stats = {"low": low, "high": high, "region": torch.maximum(low, high)}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        kl = kl * ratio if kl_ratio else kl
        loss = loss + beta * kl
        stats["kl"] = kl.detach()
    return loss, stats


def loss_sum(loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The micro-batch's share of the loss before division by `units`: grpo the sum of each completion's token
    mean; the others the token sum."""
    if loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type in LOSSES:
        return (loss * mask).sum()
    raise ValueError(f"loss {loss_type!r}: one of {', '.join(LOSSES)}")


def units(mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """What the loss is a mean over in these completions (a 0-dim int64 tensor, as engines/base.py's global_counts
    adds them up over the global batch): completions (grpo), completions x max_completion_length (dr_grpo),
    completion tokens (bnpo, dapo)."""
    if loss_type == "grpo":
        return torch.tensor(mask.shape[0], device=mask.device)
    if loss_type == "dr_grpo":
        return torch.tensor(mask.shape[0] * max_completion_length, device=mask.device)
    return mask.sum().long()


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int, num_items=None
) -> torch.Tensor:
    """TRL's loss of one micro-batch on one process without accumulation: loss_sum / units, dapo's units being
    `num_items` (the generation batch's completion tokens over every process) when given."""
    count = (
        num_items if loss_type == "dapo" and num_items is not None else units(mask, loss_type, max_completion_length)
    )
    return loss_sum(loss, mask, loss_type) / torch.as_tensor(count, dtype=loss.dtype).clamp(min=1.0)


def stat_sums(stats: dict[str, torch.Tensor], entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """STATS summed over the completion tokens (kl 0 without a reference): a step's TRL means are each / tokens."""
    m = mask.float()
    kl = stats.get("kl", torch.zeros_like(m))
    parts = [m, stats["low"], stats["high"], stats["region"], kl, entropies]
    return torch.stack([(p * m).sum() for p in parts])


def clip_extremes(stats: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """[2]: TRL's clip_ratio/low_min and clip_ratio/high_max over these completions: the least share of low-clipped
    tokens of any completion and the greatest of high-clipped ones (completions without tokens left out; NaN if
    none has any). Over ranks: the min of the first and the max of the second."""
    m = mask.float()
    tokens = m.sum(-1)
    real = tokens > 0
    if not real.any():
        return torch.full((2,), float("nan"), device=mask.device)
    low = ((stats["low"] * m).sum(-1) / tokens.clamp(min=1))[real]
    high = ((stats["high"] * m).sum(-1) / tokens.clamp(min=1))[real]
    return torch.stack([low.min(), high.max()])
