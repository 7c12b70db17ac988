"""Activation offload (--activation-offload): the tensors a forward saves for backward wait in host memory.

torch's saved-tensor hooks see every tensor autograd saves; `ActivationOffload` moves the large ones
(at least MIN_BYTES, not parameters) to pinned host memory as they are saved and brings them back when
backward unpacks them. On a GPU the copies run on a side stream: device-to-host while the forward goes
on (the device memory is released to the caching allocator once the copy is done, `record_stream`), and
host-to-device PREFETCH tensors ahead of backward's reverse order, so the copies overlap compute. (This is
torch's `save_on_cpu` with the copies taken off the compute stream, as torchtune's offloading does.)

With activation checkpointing a checkpointed block saves only its input (torch.utils.checkpoint saves
it as a saved tensor, under these hooks); its insides are recomputed in backward, outside them. So the
two compose: checkpointing keeps one tensor per block, offload moves that one to the host (the scheme of
DeepSpeed's long-sequence training). On CPU ranks activations already are in host memory: nothing moves.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.compat import view_base

MIN_BYTES = 1 << 20  # smaller saved tensors (norm statistics, masks, ids) stay: the copy would cost more
PREFETCH = 2  # tensors brought back ahead of the one backward asks for


class _Offloaded:
    """One saved tensor while it is away: the host copy, and its device copy once fetched back."""

    __slots__ = ("host", "back", "device")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.back, self.device = host, None, device


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Use as `with ActivationOffload(device):` around one forward (a new context for each forward).
    `device`: where activations live; tensors elsewhere (and small ones) are saved as they are.
    `offloaded_bytes` counts what went to the host."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES):
        self.device, self.min_bytes = torch.device(device), min_bytes
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.saved: list[_Offloaded | None] = []  # in the order the forward saved them
        self.offloaded_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _keep(self, t: torch.Tensor) -> bool:
        return (
            t.device != self.device
            or t.nbytes < self.min_bytes
            or isinstance(t, nn.Parameter)
            or isinstance(view_base(t), nn.Parameter)  # a weight's transpose, saved by a matmul
            or type(t) is not torch.Tensor  # DTensors and other subclasses keep their own placement
        )

    def _pack(self, t: torch.Tensor):
        if self._keep(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is computed
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(t)
        self.offloaded_bytes += t.nbytes
        self.saved.append(_Offloaded(host, self.device))
        return (len(self.saved) - 1, self.saved[-1])

    def _fetch(self, item: _Offloaded | None) -> None:
        if item is None or item.back is not None:
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                item.back = item.host.to(item.device, non_blocking=True)
        else:
            item.back = item.host.to(item.device, copy=True)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        index, item = packed
        self._fetch(item)
        for ahead in self.saved[max(0, index - PREFETCH) : index][::-1]:  # backward runs roughly in reverse
            self._fetch(ahead)
        t, item.back = item.back, None
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            t.record_stream(torch.cuda.current_stream(self.device))
        self.saved[index] = None  # the host copy now lives as long as autograd keeps the packed handle
        return t
