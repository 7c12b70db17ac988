"""Activation checkpointing per transformer block: keep only each checkpointed block's input and
recompute its insides during backward, trading about one extra forward for activation memory.

--activation-checkpointing none | full (every block) | every-N (blocks N, 2N, ... counting from 1).
It wraps blocks in place, so it works under every strategy; apply.py runs it after tensor
parallel (which rewrites the blocks' insides) and before FSDP/DDP (which wrap the blocks).
"""

from __future__ import annotations

import torch

from meshlm.compat import checkpoint_wrapper
from meshlm.models.families import transformer_blocks


def checkpoint_every(mode: str) -> int:
    """0 for none, else N: checkpoint every N-th block (config.validate has checked the spelling)."""
    if mode == "none":
        return 0
    return 1 if mode == "full" else int(mode.removeprefix("every-"))


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Wrap the chosen blocks; returns how many were wrapped."""
    every = checkpoint_every(mode)
    if not every:
        return 0
    blocks = transformer_blocks(model)
    wrapped = 0
    for i in range(len(blocks)):
        if (i + 1) % every == 0:
            # Non-reentrant checkpointing (the wrapper's default) works with FSDP's hooks and
            # kwargs-only block signatures; RNG state is restored so dropout recomputes identically.
            blocks[i] = checkpoint_wrapper(blocks[i])
            wrapped += 1
    return wrapped
