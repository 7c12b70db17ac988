"""ZeRO-1 and ZeRO-2 under bf16 mixed precision, as the ZeRO paper defines them.

The model's working parameters are bf16 on every rank (forward and backward run in bf16, no
autocast). Every parameter has one owner rank (a size-balanced partition, as PyTorch's
ZeroRedundancyOptimizer makes), which alone keeps its fp32 master copy and AdamW's two fp32
moments, updates the master from the reduced bf16 gradient, and broadcasts the new bf16 value:

  zero1   DDP all-reduces the bf16 gradients; every rank keeps them all    2 + 2 + 12/N bytes/param
  zero2   each gradient is reduced to its owner as soon as backward has
          produced it and freed on the other ranks                         2 + (2 + 12)/N

FSDP2's MixedPrecisionPolicy cannot give these: its sharded gradients have the sharded
parameters' dtype (fp32), and zero1 has no FSDP form. Tensor/pipeline parallel zero2 keeps FSDP2.

The optimizer's state per owned parameter is {step, exp_avg, exp_avg_sq, master} in the plain
torch.optim layout (other ranks' parameters: empty), so DCP checkpoints hold each state once and
resume exactly, masters included.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.compat import clip_grads_with_norm_, flatten_dense_tensors, unflatten_dense_tensors
from meshlm.engines.base import Engine, EngineOptions, global_grad_norm
from meshlm.parallel.ddp import replicate


def owners(params: list[torch.Tensor], n: int) -> list[int]:
    """Owner rank of each parameter: largest first to the least loaded rank."""
    load, owner = [0] * n, [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        r = min(range(n), key=load.__getitem__)
        owner[i], load[r] = r, load[r] + params[i].numel()
    return owner


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW whose param_groups are the model's bf16 parameters (what DCP maps to names) and whose
    arithmetic runs on this rank's fp32 masters (an inner AdamW over them)."""

    def __init__(self, groups, masters: dict, owner: dict, group, ranks: list[int], **kw):
        super().__init__(groups, {k: v for k, v in kw.items() if k != "foreach"})
        self.masters, self.owner, self.group, self.ranks = masters, owner, group, ranks
        self.inner = torch.optim.AdamW(
            [
                {**self._options(g), "params": [masters[p] for p in g["params"] if p in masters]}
                for g in self.param_groups
            ],
            foreach=True,
        )

    @staticmethod
    def _options(g: dict) -> dict:
        return {k: v for k, v in g.items() if k != "params"}

    @torch.no_grad()
    def step(self, closure=None):
        for g, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update(self._options(g))  # the scheduler sets lr on the outer groups
        for p, m in self.masters.items():
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in self.masters.items():
            m.grad = None
            if m in self.inner.state:
                self.state[p] = self.inner.state[m]
                self.state[p]["master"] = m
        self._broadcast_updates()

    def _broadcast_updates(self) -> None:
        """Each owner's new bf16 values, flattened into one broadcast per owner."""
        params = [p for g in self.param_groups for p in g["params"]]
        for r, src in enumerate(self.ranks):
            mine = [p for p in params if self.owner[p] == r]
            if not mine:
                continue
            if src == dist.get_rank():
                for p in mine:
                    p.copy_(self.masters[p])
            flat = flatten_dense_tensors([p.detach() for p in mine])
            dist.broadcast(flat, src=src, group=self.group)
            for p, v in zip(mine, unflatten_dense_tensors(flat, mine), strict=True):
                p.copy_(v)

    def state_dict(self) -> dict:
        """torch.optim layout; parameters owned elsewhere have empty states (DCP writes nothing for them)."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = [{**self._options(g), "params": [index[p] for p in g["params"]]} for g in self.param_groups]
        state = {index[p]: dict(self.state[p]) if p in self.masters else {} for p in index}
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for key, p in zip(keys, params, strict=True):
            saved = state_dict["state"].get(key)
            if p not in self.masters or not saved:
                continue
            m = self.masters[p]
            m.copy_(saved["master"])
            p.copy_(m)
            st = {k: v.to(m.device) if torch.is_tensor(v) and v.dim() else v for k, v in saved.items() if k != "master"}
            st["master"] = m
            self.inner.state[m] = self.state[p] = st
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})


class MasterWeightEngine(Engine):
    """zero1 / zero2 with bf16 working parameters and gradients, fp32 masters owned per rank: the engine of
    layout kind "masters" (layout.Layout.masters says when)."""

    def __init__(self, model, layout, rt, options: EngineOptions = EngineOptions(), ddp: type[DDP] = DDP):
        super().__init__(model, layout, rt, options)
        self.name, self.sync = layout.strategy, True
        self.ranks = dist.get_process_group_ranks(self.dp_group)
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in params:  # rank 0's fp32 values become everyone's masters and working copies
                dist.broadcast(p.data, src=self.ranks[0], group=self.dp_group)
        self.owner = dict(zip(params, owners(params, self.dp_size), strict=True))
        self.masters = {p: p.detach().clone() for p in params if self.owner[p] == self.dp_rank}
        for p in params:  # parameters only: buffers (rotary frequencies) keep their dtype
            p.data = p.data.to(torch.bfloat16)
        if layout.replicated:  # zero1: DDP all-reduces the bf16 gradients
            self.model = replicate(model, False, rt.device, self.dp_group, ddp)
        else:
            for p in params:
                p.register_post_accumulate_grad_hook(self._reduce_to_owner)

    def _reduce_to_owner(self, p: torch.Tensor) -> None:
        """zero2: the averaged gradient goes to its owner; the other ranks drop theirs right away."""
        if not self.sync:
            return
        p.grad.div_(self.dp_size)
        dist.reduce(p.grad, dst=self.ranks[self.owner[p]], group=self.dp_group)
        if self.owner[p] != self.dp_rank:
            p.grad = None

    def autocast(self):
        return contextlib.nullcontext()  # the parameters are bf16 already

    @contextlib.contextmanager
    def no_sync(self):
        if isinstance(self.model, DDP):  # zero1
            with self.model.no_sync():
                yield
            return
        self.sync = False  # zero2 accumulates whole local gradients until the last micro-batch
        try:
            yield
        finally:
            self.sync = True

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if isinstance(self.model, DDP):  # zero1
            return super().clip_grad_norm(max_norm)
        owned = [p for p in self.parameters() if p.grad is not None]
        square = global_grad_norm([p.grad for p in owned]).to(self.rt.device).float() ** 2
        dist.all_reduce(square, group=self.dp_group)
        norm = square.sqrt()
        if max_norm > 0 and owned:  # torch reads .grad of what it is given: parameters, not gradients
            clip_grads_with_norm_(owned, max_norm, norm)
        return norm

    def make_optimizer(self, **kw) -> torch.optim.Optimizer:
        groups = self.param_groups(kw.pop("weight_decay"))
        return MasterWeightAdamW(groups, self.masters, self.owner, self.dp_group, self.ranks, **kw)
