"""The DDP engine: the whole model replicated by parallel/ddp.py `replicate`; `no_sync` skips the all-reduce
for all but the last micro-batch of a gradient accumulation step."""

from __future__ import annotations

from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.engines.base import Engine, EngineOptions
from meshlm.parallel.ddp import replicate


def ddp_step_temporaries(engine: Engine) -> bool:
    """weight_sized_temporaries of a DDP-wrapped model: not its gradients, views of DDP's buckets, which stay
    (gradient_as_bucket_view); only foreach AdamW's copy, where parameters are DTensors (fused AdamW has none)."""
    return "foreach" in engine.adamw_impl()


@dataclass(frozen=True)
class DDPOptions(EngineOptions):
    sync_batchnorm: bool = False  # --sync-batchnorm, for a bare module DDPEngine wraps itself

    @classmethod
    def of(cls, cfg) -> DDPOptions:
        return super().of(cfg, sync_batchnorm=cfg.sync_batchnorm)


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, model, layout, rt, options: DDPOptions = DDPOptions()):
        super().__init__(model, layout, rt, options)
        if not isinstance(model, DDP):  # parallelize hands it wrapped; a bare module (direct use) is wrapped here
            self.model = replicate(model, options.sync_batchnorm, rt.device, self.grad_group)

    def no_sync(self):
        return self.model.no_sync()

    def weight_sized_temporaries(self) -> bool:
        return ddp_step_temporaries(self)
