"""Live tensor bytes over a block of code, op by op: what `meshlm plan --simulate` counts on fake tensors.

A TorchDispatchMode sees every op's outputs (DTensor ops are handed back so that their local shards reach
it); each new storage is counted until Python frees it (a weakref finalizer). Storages still alive at the
end are what the step keeps (gradients, optimizer states, buffers); the peak of the others, replayed in
order, is the step's activations and temporaries, as the probe of `plan --validate` counts them.
Storages that exist before the block (`resident`: parameters, buffers) are never counted: FSDP2 makes new
views of its parameter shards at its first forward, which would otherwise count them a second time. Nor is
what DTensor's sharding propagation computes: it runs each op once more on global-shape stand-ins, in the
fake mode it finds (ours), to learn the output's shape; on a GPU that happens on fake tensors, not in memory.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from meshlm.compat import (
    TorchDispatchMode,
    shape_propagation_counted,
    storage_key,
    storage_resizes_observed,
    tree_leaves,
)


class LiveBytes(TorchDispatchMode):
    def __init__(self, resident=()):
        super().__init__()
        self.resident = {storage_key(t.untyped_storage()) for t in resident}
        self.sizes: dict[int, int] = {}  # storage key -> bytes, while alive
        # storage key -> its allocation's number, while alive: a key is an address, which a later storage reuses
        self.allocations: dict[int, int] = {}
        self.events: list[tuple[int, int, str]] = []  # (allocation, +bytes / -bytes, phase) in order
        self.phase_peaks: dict[str, int] = {}
        self.phase = "step"
        self._live = 0
        self._shapes_only = 0  # inside DTensor's shape propagation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if self._shapes_only:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and not t.is_meta:  # meta: no memory
                self._add(t.untyped_storage())
        return out

    def __enter__(self):
        self._resizes = storage_resizes_observed(self._resizing)
        self._resizes.__enter__()
        self._propagation = shape_propagation_counted(self._enter_shapes, self._leave_shapes)
        self._propagation.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._resizes.__exit__(None, None, None)
        self._propagation.__exit__(None, None, None)
        return super().__exit__(*exc)

    def _resizing(self, st):
        """FSDP2 frees gathered parameters by resizing their storage to 0: the bytes change in place."""
        key, before = storage_key(st), st.nbytes()

        def done() -> None:
            if key in self.sizes and st.nbytes() != before:
                self.sizes[key] = st.nbytes()
                self._change(self.allocations[key], st.nbytes() - before)

        return done

    def _enter_shapes(self) -> None:
        self._shapes_only += 1

    def _leave_shapes(self) -> None:
        self._shapes_only -= 1

    def _add(self, st) -> None:
        key = storage_key(st)
        if key in self.sizes or key in self.resident or not st.nbytes():
            return
        self.sizes[key] = st.nbytes()
        self.allocations[key] = len(self.events)
        self._change(self.allocations[key], st.nbytes())
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        if key in self.sizes:
            self._change(self.allocations.pop(key), -self.sizes.pop(key))

    def _change(self, allocation: int, delta: int) -> None:
        self.events.append((allocation, delta, self.phase))
        self._live += delta
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self._live)

    def _kept(self) -> set[int]:
        """The allocations still alive (resized to nothing counts as freed: FSDP2's gathered parameters)."""
        return {self.allocations[k] for k, n in self.sizes.items() if n}

    def transient_peak(self, phases: tuple[str, ...]) -> tuple[int, int]:
        """(peak over `phases` of the storages the block also freed, bytes of those it kept)."""
        kept = self._kept()
        running = peak = 0
        for allocation, delta, phase in self.events:
            if allocation not in kept:
                running += delta
                if phase in phases:
                    peak = max(peak, running)
        return peak, sum(self.sizes.values())

    def totals_at(self, marks: list[int]) -> list[tuple[int, int]]:
        """For each n in `marks` (increasing): (bytes live after the first n events, of them those of storages
        the block also freed), as transient_peak counts them."""
        kept = self._kept()
        out, live, freed = [], 0, 0
        ends = iter(marks)
        end = next(ends, None)
        for i, (allocation, delta, _) in enumerate((*self.events, (None, 0, ""))):
            while end == i:
                out.append((live, freed))
                end = next(ends, None)
            live += delta
            freed += delta if allocation not in kept else 0
        return out
