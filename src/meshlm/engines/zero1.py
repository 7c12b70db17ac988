"""ZeRO-1: DDP for the gradients (all-reduced, every rank keeps whole parameters and gradients)
plus PyTorch's ZeroRedundancyOptimizer for the optimizer states: each rank owns whole
parameters (a size-balanced partition), keeps AdamW states only for those, updates them,
and broadcasts the updated parameters to the other ranks.

Checkpoints: ZeroRedundancyOptimizer's own state_dict needs a full gather on one rank first
(`consolidate_state_dict`). `ShardedStateZeRO` instead answers `state_dict()` with the plain
per-parameter layout restricted to the parameters this rank owns, so DCP's get/set_state_dict
see an ordinary optimizer: each rank writes only its own states, and the files are the same
FQN-keyed entries every other layout writes, so any layout can load them and this one can
load theirs.
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from meshlm.compat import zero_owner, zero_param_index, zero_sync_param_groups
from meshlm.engines.base import Engine, EngineOptions
from meshlm.engines.ddp import ddp_step_temporaries


class ShardedStateZeRO(ZeroRedundancyOptimizer):
    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        # The exposed `state` is this rank's states. DCP decides whether an optimizer still needs
        # its lazily created states (and then runs a zero-lr step) by looking here.
        self.state = self.optim.state

    def _owned(self, p: torch.Tensor) -> bool:
        return zero_owner(self, p) == self.rank

    def state_dict(self) -> dict:
        """torch.optim layout (global parameter indices); parameters owned elsewhere have empty states,
        which DCP neither writes nor reads, but which tell DCP's strict check that none is missing."""
        index = zero_param_index(self)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
            for g in self.param_groups
        ]
        state = {
            index[p]: self.optim.state[p] if self._owned(p) else {} for g in self.param_groups for p in g["params"]
        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Accepts that layout, keyed by index or (from DCP's set_state_dict) by FQN, in parameter order."""
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for key, p in zip(keys, params, strict=True):
            if self._owned(p) and key in state_dict["state"]:
                self.optim.state[p] = {
                    name: v.to(p.device) if torch.is_tensor(v) and v.dim() else v
                    for name, v in state_dict["state"][key].items()
                }
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        zero_sync_param_groups(self)


class ZeroOneEngine(Engine):
    name = "zero1"

    def __init__(self, model, layout, rt, options: EngineOptions = EngineOptions()):
        super().__init__(model, layout, rt, options)  # model: DDP-wrapped by parallelize (parallel/ddp.py replicate)

    def no_sync(self):
        return self.model.no_sync()

    def weight_sized_temporaries(self) -> bool:
        return ddp_step_temporaries(self)

    def make_optimizer(self, **kw) -> torch.optim.Optimizer:
        groups = self.param_groups(kw.pop("weight_decay"))
        return ShardedStateZeRO(
            groups, optimizer_class=torch.optim.AdamW, process_group=self.grad_group, **kw, **self.adamw_impl()
        )
