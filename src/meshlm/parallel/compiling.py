"""`--compile`: torch.compile each transformer block in place, as torchtitan does.

Per block rather than the whole model: the wrappers applied after it (FSDP's per-block units,
DDP's hooks, a pipeline's stage split) see the same modules as without compile. (Dynamo traces
each block once: a 4-block model gives 4 graphs.) `Module.compile` keeps each block's class and name, so
checkpoints, tensor-parallel plans and `transformer_blocks` are unchanged. apply.py runs it after
tensor parallel and activation checkpointing (a checkpointed block is compiled with its
recomputation) and before FSDP/DDP.

Worth it for long runs: Inductor fuses the element-wise work around the matrix multiplications
(norms, rotary embeddings, SiLU gating), at the price of a compile before the first step
(BENCHMARKS.md has both numbers).
"""

from __future__ import annotations

import torch

from meshlm.models.families import transformer_blocks


def apply_compile(model: torch.nn.Module) -> int:
    """Compile every transformer block of `model` in place; returns how many were compiled."""
    blocks = transformer_blocks(model)
    for block in blocks:
        # Not fullgraph: a model's block may hold code Dynamo cannot trace (it then runs that part eagerly).
        block.compile()
    return len(blocks)
