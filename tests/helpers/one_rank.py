"""A 1-rank gloo process group for a unit test of code that needs one (FSDP, DTensor, a device mesh): the group a
test found already, or one of its own, destroyed after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def one_rank_group() -> Iterator[None]:
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if mine:
            dist.destroy_process_group()
