"""A batch of packed token blocks: ids, labels (-100 where nothing is learned) and position ids.

Position ids restart at every document of a packed block; transformers' masking
(`find_packed_sequence_indices`) reads those restarts and builds a block-diagonal
causal mask, so attention never crosses a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # the label of a position that is not a target (the Hugging Face convention)


@dataclass
class Batch:
    ids: torch.Tensor  # [batch, seq] token ids
    labels: torch.Tensor  # [batch, seq] the token each position is (label[i] is predicted from ids[:i])
    positions: torch.Tensor  # [batch, seq] position ids, restarting at each document
    pad_tokens: int = 0  # positions that hold no document
    # --objective dpo: the reference model's log-probabilities of each pair's responses, [batch, pairs, 2]
    # (objectives/dpo_loss.py; from the precomputed cache, or objectives/dpo.py fills them before the step)
    reference: torch.Tensor | None = None

    def to(self, device) -> Batch:
        return Batch(
            *(t.to(device, dtype=torch.long, non_blocking=True) for t in (self.ids, self.labels, self.positions)),
            self.pad_tokens,
            None if self.reference is None else self.reference.to(device, non_blocking=True),
        )

    def split(self, size: int) -> list[Batch]:
        """Chunks of `size` sequences (pad counts are not split: chunks are for compute, not for logging)."""
        return self._parts(lambda t: t.split(size))

    def chunks(self, n: int) -> list[Batch]:
        """n chunks of rows, as torch.tensor_split makes them (a pipeline's micro-batches)."""
        return self._parts(lambda t: t.tensor_split(n))

    @staticmethod
    def cat(batches: list[Batch]) -> Batch:
        """The rows of `batches` one after another."""
        refs = [b.reference for b in batches]
        return Batch(
            *(torch.cat(ts) for ts in zip(*((b.ids, b.labels, b.positions) for b in batches))),
            sum(b.pad_tokens for b in batches),
            None if any(r is None for r in refs) else torch.cat(refs),
        )

    def _parts(self, cut) -> list[Batch]:
        refs = cut(self.reference) if self.reference is not None else None
        parts = zip(*(cut(t) for t in (self.ids, self.labels, self.positions)))
        return [Batch(*p, reference=None if refs is None else refs[i]) for i, p in enumerate(parts)]

    def targets(self) -> torch.Tensor:
        """How many positions are a target (a 0-dim tensor where the labels are: no host sync): every
        labelled position but the first of each sequence (nothing precedes it)."""
        return (self.labels[:, 1:] != IGNORE).sum()

    @staticmethod
    def of_ids(ids: torch.Tensor) -> Batch:
        """Unpacked blocks where every token is a target (the classic recipe)."""
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return Batch(ids, ids, positions)
