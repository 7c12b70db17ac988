"""Legacy single-process nn.DataParallel over all local GPUs.

Each step it scatters the batch, replicates the module to every GPU, and
gathers outputs on GPU 0: one Python process drives every device, which is why
DistributedDataParallel (one process per GPU) is faster. On a CPU-only machine
it degenerates to one device, which keeps the code path testable.
"""

from __future__ import annotations

import torch

from meshlm.parallel.engine import Engine
from meshlm.runtime import log


class DataParallelEngine(Engine):
    name = "dp"

    def __init__(self, model, cfg, rt, mesh=None):
        super().__init__(model, cfg, rt, mesh)
        log.warning("strategy dp (nn.DataParallel) is single-process and slower than ddp; "
                    "prefer `--strategy ddp --nproc N`")
        if torch.cuda.device_count() > 1:
            self.model = torch.nn.DataParallel(model)
