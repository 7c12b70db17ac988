"""What the trainer sees of a parallel layout: a small interface with single-process defaults.

The trainer never asks which technique is active; it calls `train_step`,
`clip_grad_norm`, `make_optimizer`, and reads `dp_size` / `dp_rank` for data.
Each technique's file subclasses Engine and overrides only what differs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshlm.config import Config
from meshlm.runtime import Runtime


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Engine:
    name = "single"

    def __init__(self, model: torch.nn.Module, cfg: Config, rt: Runtime, mesh=None):
        self.model, self.cfg, self.rt, self.mesh = model, cfg, rt, mesh
        self.dp_size, self.dp_rank = 1, 0
        if mesh is not None:
            self.dp_size, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        self.dp_group = mesh["dp"].get_group() if mesh is not None and self.dp_size > 1 else None

    @property
    def module(self) -> torch.nn.Module:
        """The model without DDP/DataParallel wrappers: what checkpoints and export see."""
        m = self.model
        while isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            m = m.module
        return m

    # ------------------------------------------------------------- training
    def autocast(self):
        if self.cfg.mixed_precision == "bf16":
            return torch.autocast(self.rt.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def no_sync(self):
        """Skip gradient communication for micro-batches before the last one."""
        return contextlib.nullcontext()

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model(input_ids=ids, labels=ids).loss

    def train_step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; returns their mean loss (detached)."""
        total = torch.zeros((), device=self.rt.device)
        n = len(micro_batches)
        for i, ids in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == n - 1 else self.no_sync()
            with sync:
                loss = self.loss(ids) / n
                loss.backward()
            total += loss.detach()
        return total

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self, **kw) -> torch.optim.Optimizer:
        params = self.parameters()
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": kw.pop("weight_decay")}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, **kw, **self.adamw_impl())

    def adamw_impl(self) -> dict:
        """Fused AdamW where the device has it (CUDA, and CPU since torch 2.4) for plain tensors."""
        if any(isinstance(p, DTensor) for p in self.parameters()):
            return {"foreach": True}
        return {"fused": True}

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (max_norm 0: only measure it) and return it."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over the data-parallel ranks (the logged loss)."""
        if self.dp_group is None:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.dp_group)
        return value / self.dp_size

    # -------------------------------------------------------------- memory
    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds of parameters, gradients and optimizer states (local shards only)."""
        seen, total = set(), 0

        def add(t):
            nonlocal total
            if isinstance(t, torch.Tensor):
                t = local(t)
                key = t.untyped_storage().data_ptr()
                if key not in seen and t.numel():
                    seen.add(key)
                    total += t.untyped_storage().nbytes()

        for p in self.model.parameters():
            add(p)
            add(p.grad)
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:  # skip the scalar `step` counters
                    add(v)
        return total
