"""The loss head: the token-exact cross-entropy and the LM head that computes it over chunks of tokens.

The LM head's logits are [tokens, vocabulary] in fp32: at 32k tokens and a 128k vocabulary, 16 GiB, and
as much again for their gradient. `ChunkedLossHead` never builds them whole: it computes the loss over
chunks of tokens, so a chunk's logits are the largest loss tensor alive. With a plain weight the gradients
are computed in forward, chunk by chunk, and backward only scales them (a fused linear cross-entropy, as
Liger's): no more head matmuls than the whole logits take, and only for the positions that have a target
(`_target_rows`: a prompt token under --loss-on responses needs no logits). Recomputing each chunk's logits in
backward instead (torch.utils.checkpoint) cost one more head forward per token: +12% CPU seconds over the whole
logits for benchmarks/chunked_loss_time.py's model, whose head is most of its FLOPs; fused, -15% (BENCHMARKS.md
17). Under tensor parallel (a DTensor weight) the chunks are checkpointed: the logits stay sharded over the
vocabulary and the cross-entropy is torch's `loss_parallel`. The head is a transform of the model (apply.py swaps
it in; tensor parallel shards it, a pipeline's last stage holds it), so it lives with the other transforms; what a
step's loss is a mean over, and the objectives, are in meshlm/objectives/.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from meshlm import compat
from meshlm.data.batch import IGNORE

CHUNK_ELEMENTS = 1 << 24  # logits per chunk (64 MiB in fp32): the chunk's tokens = this / vocabulary (per TP rank)


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """bf16 and fp16 logits in fp32 for the loss; fp32 and fp64 as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies of every target (logits[:, i] predicts labels[:, i + 1]), in fp32."""
    return targets_loss_sum(logits[:, :-1], labels[:, 1:])


def targets_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies of logits[..., i, :] against targets[..., i] (IGNORE: not a target), in fp32
    (fp64 logits: in fp64)."""
    logits = _at_least_fp32(logits)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1).to(logits.device),
        ignore_index=IGNORE,
        reduction="sum",
    )


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels -> [B, S] targets aligned with the positions that predict them: targets[:, i] =
    labels[:, i + 1], the last position none. Aligned targets can be cut anywhere along the sequence
    (into chunks, or over context-parallel ranks) and each piece keeps its own."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def chunk_tokens(setting: str, vocab: int, tokens: int, fused_hidden: int = 0) -> int:
    """--chunked-loss: tokens per chunk, or 0 for the whole logits at once. auto chunks where the logits of a
    micro-batch span more than one chunk of CHUNK_ELEMENTS (where chunking saves memory), and where the head's
    loss is fused (`fused_hidden`: its hidden size, for a plain weight; 0 under tensor parallel) also in one
    chunk once the micro-batch's logits [tokens, vocab] are no smaller than the fp32 weight gradient [vocab,
    hidden] the fused loss keeps (tokens >= hidden): it then holds less than the whole logits, runs the head's
    matmuls once, and skips the positions without a target (_target_rows)."""
    if setting == "off":
        return 0
    chunk = max(1, CHUNK_ELEMENTS // vocab) if setting in ("auto", "on") else int(setting)
    if setting != "auto" or tokens > chunk:
        return chunk
    return tokens if fused_hidden and tokens >= fused_hidden else 0


def _target_rows(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions that have a target (hidden [T, H], targets [T]): a position without one adds neither loss nor
    gradient, so its logits need not be made (an SFT job's prompt tokens: half the head's work on an
    Alpaca-like job). The index is data-dependent (a host sync on a GPU, one per micro-batch); under `plan --simulate`
    (fake tensors, no values) every position is kept, as the planner prices them."""
    targets = targets.to(hidden.device)
    if isinstance(targets, compat.FakeTensor):
        return hidden, targets
    rows = (targets != IGNORE).nonzero().squeeze(1)
    if rows.numel() == targets.numel():
        return hidden, targets
    return hidden.index_select(0, rows), targets.index_select(0, rows)


def _chunk_loss(hidden, weight, bias, targets):
    return targets_loss_sum(F.linear(hidden, weight, bias), targets)


class _FusedChunkedLoss(torch.autograd.Function):
    """The summed cross-entropy of hidden [T, H] through the head (weight [V, H], bias) against targets [T], one
    chunk of tokens at a time; each chunk's gradients of hidden, weight and bias are made from its logits at
    once (softmax - one-hot, zero for IGNORE), so backward only multiplies them, in place, by the loss's gradient.
    The fp32 weight gradient is kept from forward to backward (the planner counts it: plan/activations.py
    head_activation_bytes); a chunk's logits and log-probabilities are the only other loss tensors alive."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int):
        wide = torch.promote_types(weight.dtype, torch.float32)  # what the loss and the head's gradients sum in
        total = torch.zeros((), dtype=wide, device=hidden.device)
        grad_h = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_w = torch.zeros_like(weight, dtype=wide) if weight.requires_grad else None
        grad_b = torch.zeros_like(bias, dtype=wide) if bias is not None and bias.requires_grad else None
        for a in range(0, hidden.shape[0], chunk):
            h, t = hidden[a : a + chunk], targets[a : a + chunk].to(hidden.device)
            loss, grad = _chunk_loss_and_grad(F.linear(h, weight, bias), t)
            total += loss
            if grad_h is not None:
                grad_h[a : a + chunk] = grad @ weight.to(grad.dtype)
            if grad_w is not None and grad.dtype == grad_w.dtype:
                grad_w.addmm_(grad.t(), h)  # no [V, H] temporary per chunk
            elif grad_w is not None:
                grad_w += grad.t() @ h.to(grad.dtype)
            if grad_b is not None:
                grad_b += _at_least_fp32(grad).sum(0)
            del grad  # before the next chunk's logits: else three chunk-sized tensors are alive, not two
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes, ctx.chunk = (weight.dtype, None if bias is None else bias.dtype), chunk
        return total

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scaled = [None if x is None else _scale(x, _at_least_fp32(g), ctx.chunk) for x in (grad_h, grad_w, grad_b)]
        w_dtype, b_dtype = ctx.dtypes
        return (
            scaled[0],
            None if scaled[1] is None else scaled[1].to(w_dtype),
            None if scaled[2] is None else scaled[2].to(b_dtype),
            None,
            None,
        )


def _scale(x: torch.Tensor, g: torch.Tensor, chunk: int) -> torch.Tensor:
    """x *= g in place, the product in fp32: the loss's gradient (dp / targets, e.g. 2 / 157) rounded to bf16 is up
    to 0.4% off, the same way for every element of a micro-batch's hidden-state gradient. A chunk of rows at a time:
    an fp32 copy of all of a long sequence's rows would cost more than the loss head's other tensors."""
    if x.dtype in (torch.float32, torch.float64):
        return x.mul_(g.to(x.dtype))
    for a in range(0, x.shape[0], chunk):
        x[a : a + chunk] = x[a : a + chunk].float().mul_(g)
    return x


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's summed cross-entropy (fp32) and its gradient against the logits (in the logits' dtype), the
    softmax made in place from the log-probabilities: two chunk-sized tensors at most, the logits freed first.
    No shape depends on the targets' values (no nonzero or boolean indexing), so `plan --simulate` runs it on
    fake tensors."""
    dtype = logits.dtype
    logp = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    del logits
    keep = (targets != IGNORE).unsqueeze(1)
    index = torch.where(keep, targets.unsqueeze(1), 0)
    loss = -torch.where(keep, logp.gather(1, index), 0.0).sum()
    grad = logp.exp_()
    grad.scatter_add_(1, index, -keep.to(grad.dtype))  # minus the one-hot of each target
    grad.mul_(keep)  # positions without a target have no gradient
    return loss, grad.to(dtype)


class ChunkedLossHead(nn.Linear):
    """The LM head (the model's own weight and bias) that, while `targets` is set, returns the summed
    cross-entropy of those targets (aligned: next_token_targets) instead of logits. It runs as the head
    module, so FSDP gathers its weight once and tensor parallel shards it as the head; inside, each chunk
    of `chunk` tokens is a checkpointed function: its logits are freed after forward and recomputed in
    backward (or, with a plain weight, fused: _FusedChunkedLoss). Without targets (generation, export) it is the
    plain head."""

    targets: torch.Tensor | None = None
    chunk: int = 0

    @staticmethod
    def of(head: nn.Linear, chunk: int) -> ChunkedLossHead:
        with torch.device("meta"):
            new = ChunkedLossHead(head.in_features, head.out_features, bias=head.bias is not None)
        new.weight, new.bias, new.chunk = head.weight, head.bias, chunk  # the same parameters (a tie stays)
        return new

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = self.targets.reshape(-1)
        if not isinstance(self.weight, DTensor) and not isinstance(hidden, DTensor):
            hidden, targets = _target_rows(hidden, targets)
            if torch.is_grad_enabled():
                return _FusedChunkedLoss.apply(hidden, self.weight, self.bias, targets, self.chunk)
        total = None
        for a in range(0, hidden.shape[0], self.chunk):
            part = checkpoint(
                _chunk_loss,
                hidden[a : a + self.chunk],
                self.weight,
                self.bias,
                targets[a : a + self.chunk],
                use_reentrant=False,
            )
            total = part if total is None else total + part
        # no position with a target (a micro-batch of prompts alone): a zero the pipeline's schedule can still sum
        return total if total is not None else (hidden.sum() * 0).float()

    @contextlib.contextmanager
    def computing_loss(self, targets: torch.Tensor):
        """While inside, the head's forward returns the loss of `targets` (one forward of the model)."""
        self.targets = targets
        try:
            yield
        finally:
            self.targets = None


def apply_chunked_loss(model: nn.Module, chunk: int) -> ChunkedLossHead | None:
    """Swap the model's LM head for a ChunkedLossHead holding the same parameters; None when chunk is 0, the
    head is not a plain Linear (a LoRA-adapted head keeps the whole logits), or the model's forward changes the
    logits after the head (models/families final_logits: it would change the loss the head returns)."""
    head = model.get_output_embeddings()
    if not chunk or type(head) is not nn.Linear:
        return None
    from meshlm.models.families.forward import changes_logits  # only where a head would compute the loss

    if changes_logits(model.config):
        return None
    new = ChunkedLossHead.of(head, chunk)
    model.set_output_embeddings(new)
    return new
