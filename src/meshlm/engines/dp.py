"""Legacy single-process nn.DataParallel over all local GPUs.

Each step it scatters the batch, replicates the module to every GPU, and
gathers outputs on GPU 0: one Python process drives every device, which is why
DistributedDataParallel (one process per GPU) is faster. On a CPU-only machine
it degenerates to one device, which keeps the code path testable.
"""

from __future__ import annotations

import torch

from meshlm.engines.base import Engine, EngineOptions
from meshlm.errors import MeshlmError
from meshlm.runtime import log


def check_dp(compile_: bool) -> None:
    """--compile compiles the blocks before the wrapper exists; DataParallel's replicas (copies made on
    every step) would then run the original module's compiled code: wrong device, lost gradients."""
    if compile_:
        raise MeshlmError(
            "--strategy dp (nn.DataParallel) does not combine with --compile; "
            "use --strategy ddp --nproc N --compile true"
        )


def wraps(device: torch.device) -> bool:
    """DataParallel only over GPUs this process computes on: never around a CPU model (--backend gloo)."""
    return device.type == "cuda" and torch.cuda.device_count() > 1


class DataParallelEngine(Engine):
    name = "dp"

    def __init__(self, model, layout, rt, options: EngineOptions = EngineOptions()):
        super().__init__(model, layout, rt, options)
        log.warning(
            "strategy dp (nn.DataParallel) is single-process and slower than ddp; prefer `--strategy ddp --nproc N`"
        )
        if wraps(rt.device):
            gpus = torch.cuda.device_count()
            self.model = torch.nn.DataParallel(model, device_ids=list(range(gpus)), output_device=rt.device)
            log.info(f"nn.DataParallel over {gpus} GPUs")  # what the GPU test and gpu-check look for
