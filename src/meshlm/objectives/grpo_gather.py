"""--grpo.gather-for-generation: under FSDP the rollout (grpo_rollout.py) gathers the whole model once, decodes
with it, and reshards it before the step's training forwards (TRL's ds3_gather_for_generation under ZeRO-3).

Decoding through the sharded model all-gathers every unit for every new token and frees it after, so the
data-parallel ranks must decode in lockstep; with the whole model gathered a decoding forward reads local weights
only, and each rank decodes on its own unless something else in the forward still talks to other data-parallel
ranks (expert parallel's all-to-all: `needs_lockstep`). The price is the whole model, in the dtype FSDP gathers,
on every rank while decoding (plan/grpo_cost.py prices it). The weights are the ones the per-unit gathers give
(FSDP's own all-gather, mixed-precision policy and tensor extensions: LoRA's adapters are in the units, an NF4 base
is gathered as NF4 and dequantised per layer as in training), so the completions are the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule


def units(model: torch.nn.Module) -> list[FSDPModule]:
    """The model's FSDP units, in module order (the same on every rank: each unshard is a collective)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def needs_lockstep(layout) -> bool:
    """Whether gathered ranks still decode in lockstep: expert parallel's token all-to-all runs in every forward
    over ranks holding other data. Tensor parallel's collectives stay among ranks decoding the same rows."""
    return layout.ep > 1


@contextmanager
def gathered(model: torch.nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Every FSDP unit of `model` gathered for the block (forwards inside it gather and free nothing); after it,
    each resharded and set back to `reshard_after_forward` (the engine's: parallel/apply.py data_parallel)."""
    found = units(model)
    for m in found:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in found:
            m.reshard()
            m.set_reshard_after_forward(reshard_after_forward, recurse=False)
