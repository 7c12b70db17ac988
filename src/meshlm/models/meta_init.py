"""Build big models without every rank holding a full copy: rank 0 builds (or loads) the real
weights, the other ranks build the same model on the meta device (shapes, no storage); after
sharding, rank 0's weights are broadcast one tensor at a time and each rank keeps only its shard.

Peak host memory is then one full model on rank 0 and one tensor elsewhere, instead of a full
model on every rank: what loading a 7B+ checkpoint on an 8-GPU node needs.
"""

from __future__ import annotations

from itertools import chain

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


def materialize(model: torch.nn.Module, full_state: dict | None, device: torch.device | str) -> None:
    """Give an already sharded model its real weights. `full_state`: rank 0's `state_dict()` taken
    before sharding (None on other ranks). Collective: every rank calls it."""
    if any(t.is_meta for t in chain(model.parameters(), model.buffers())):
        model.to_empty(device=device)
    set_model_state_dict(model, full_state or {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers (rotary inv_freq) are not in a state dict; to_empty left them garbage.
    for buf in model.buffers():
        dist.broadcast(buf, src=0)
