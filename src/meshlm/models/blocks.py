"""Find the transformer blocks of a Hugging Face causal LM: the unit of sharding and of recomputation."""

from __future__ import annotations

import torch


def _block_class_names(model: torch.nn.Module) -> set[str]:
    # transformers names the class that must never be split across devices: that is the block.
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def _unwrapped(m: torch.nn.Module) -> torch.nn.Module:
    """The block inside an activation-checkpoint wrapper (or the module itself)."""
    return getattr(m, "_checkpoint_wrapped_module", m)


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ModuleList holding the model's blocks (possibly already wrapped); works on pipeline stages too.

    Found by the class names in `_no_split_modules`; models without them fall back to the
    longest ModuleList, which is the block stack in every decoder-only architecture we know.
    """
    names = _block_class_names(model)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    for blocks in lists:
        if names and all(type(_unwrapped(b)).__name__ in names for b in blocks):
            return blocks
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of transformer blocks")
    return max(lists, key=len)
