"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in buckets
while backward is still running.

`no_sync` skips that all-reduce for all but the last micro-batch of a gradient
accumulation step, so accumulation costs one all-reduce per optimizer step.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.errors import MeshlmError
from meshlm.parallel.engine import Engine


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, model, cfg, rt, mesh):
        super().__init__(model, cfg, rt, mesh)
        if cfg.sync_batchnorm:
            has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
            if has_bn and rt.device.type != "cuda":
                raise MeshlmError("--sync-batchnorm needs GPUs: SyncBatchNorm has no CPU implementation")
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=self.dp_group)
        device_ids = [rt.device.index] if rt.device.type == "cuda" else None
        self.model = DDP(model, device_ids=device_ids, process_group=self.dp_group)

    def no_sync(self):
        return self.model.no_sync()
