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
            last = i == n - 1
            with contextlib.nullcontext() if last else self.no_sync():
                loss = self.loss(ids) / n
                if last:  # parameters as the layout holds them between forward and backward
                    self.param_bytes = storage_bytes(self.model.parameters())
                loss.backward()
            total += loss.detach()
        self.grad_bytes = storage_bytes(p.grad for p in self.model.parameters())
        return total

    def parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self, **kw) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.param_groups(kw.pop("weight_decay")), **kw, **self.adamw_impl())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices only (not on norms and biases)."""
        params = self.parameters()
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

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
    param_bytes: int | None = None  # measured by train_step
    grad_bytes: int | None = None

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds of parameters, gradients and optimizer states (local shards' storage).

        Each is taken where the layout holds the most of it: parameters between the last
        forward and its backward (ZeRO-2 keeps them gathered there, ZeRO-3 only its shards),
        gradients right after backward, optimizer states after the step. Layouts whose
        train_step does not measure fall back to what the model holds now.
        """
        params = self.param_bytes if self.param_bytes is not None else storage_bytes(self.model.parameters())
        grads = self.grad_bytes if self.grad_bytes is not None else storage_bytes(
            p.grad for p in self.model.parameters())
        # tensors only, skipping 0-dim `step` counters
        states = storage_bytes(v for s in optimizer.state.values() for v in s.values()
                               if isinstance(v, torch.Tensor) and v.ndim > 0)
        return params + grads + states


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard; None is skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = local(t).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
