"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in buckets
while backward is still running.

`replicate` is the one DDP wrap: the whole model under ddp and zero1, and each pipeline
stage (parallel/apply.py `data_parallel`). The engine's `no_sync` (engines/ddp.py) skips the
all-reduce for all but the last micro-batch of a gradient accumulation step, so accumulation
costs one all-reduce per optimizer step.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.compat import BatchNorm
from meshlm.errors import MeshlmError


def replicate(module: torch.nn.Module, sync_batchnorm: bool, device: torch.device, dp_group, ddp: type[DDP] = DDP):
    """`module` replicated over `dp_group` (BatchNorm made SyncBatchNorm first when asked) by `ddp`: DDP, or
    the fake-tensor stand-in `meshlm plan --simulate` passes."""
    if sync_batchnorm:
        has_bn = any(isinstance(m, BatchNorm) for m in module.modules())
        if has_bn and device.type != "cuda":
            raise MeshlmError("--sync-batchnorm needs GPUs: SyncBatchNorm has no CPU implementation")
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=dp_group)
    device_ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view: gradients live inside DDP's communication buckets instead of being copied
    # into them after backward: one gradient-sized buffer and one copy per step less (same numbers).
    return ddp(module, device_ids=device_ids, process_group=dp_group, gradient_as_bucket_view=True)
