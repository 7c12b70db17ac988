"""The FSDP engine (zero2, zero3, fsdp, hsdp) over a model parallel/fsdp.py `apply_fsdp` sharded: FSDP's own
bf16 policy instead of autocast, and what gradient accumulation skips per strategy."""

from __future__ import annotations

import contextlib

from meshlm.engines.base import Engine, EngineOptions
from meshlm.parallel.fsdp import mixed_precision_policy


class FSDPEngine(Engine):
    """zero2 / zero3 / fsdp / hsdp on the data-parallel part of the mesh."""

    def __init__(self, model, layout, rt, options: EngineOptions = EngineOptions()):
        super().__init__(model, layout, rt, options)  # model: sharded by parallelize (apply_fsdp)
        self.name = layout.strategy
        self.mp_policy = mixed_precision_policy(layout.precision)

    def autocast(self):
        # FSDP's policy already computes in bf16 (parameters are gathered as bf16); autocast on top
        # would only re-cast what FSDP cast.
        return contextlib.nullcontext() if self.mp_policy else super().autocast()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: what to skip on micro-batches before the last.

        zero2 keeps whole gradients locally and reduce-scatters once per step (its
        parameters are whole anyway). zero3 reduce-scatters every micro-batch: keeping
        unsharded gradients would give back the memory it exists to save. hsdp
        reduce-scatters inside the shard group every micro-batch but all-reduces across
        replica groups (the slow, inter-node link) only on the last.
        """
        if not self.layout.reshards_after_forward:  # zero2
            self.model.set_requires_gradient_sync(False)
        elif self.layout.hybrid:
            self.model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
