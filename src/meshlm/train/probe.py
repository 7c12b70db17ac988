"""The opt-in probe the trainer runs around one step (`--measure-step N`), a step hook read by
`meshlm plan --validate`.

It measures, on every rank, what the planner predicts:
- collectives: a TorchDispatchMode sees every c10d op, whether DDP's reducer issues it from C++,
  FSDP2 or ZeroRedundancyOptimizer from Python, or DTensor desugars into functional collectives
  (DTensor ops are handed back with NotImplemented so they reach us as plain-tensor collectives,
  as CommDebugMode does). Each counts its payload: the all-reduced buffer, the gathered output,
  the scattered input, the tensor sent or received.
- peak activation memory: torch.distributed._tools' MemTracker (FSDPMemTracker for FSDP2 models)
  follows every tensor storage through the dispatcher and sorts it into parameters, gradients,
  optimizer states, activations and backward temporaries; the peak of the last two over the step,
  counting only storages the step also frees, is the activation peak (persistent communication
  buffers written in backward are reported apart: see replay_without_kept). This works the same on
  CPU, where no allocator statistics exist; it agrees with saved-tensor hooks to the byte for what
  is stored (tests/test_plan.py). On CUDA the
  allocator's own peak during the step is recorded too.
- model states: Engine.model_state_bytes after the optimizer step, while gradients still exist.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshlm.compat import TorchDispatchMode, tree_leaves


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


# op name -> (kind, payload from (args)): payload is the full buffer the collective works on.
_C10D = {
    "allreduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0])),
    "allgather_": ("all_gather", lambda a: _nbytes(a[0])),
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
    "send": ("p2p", lambda a: _nbytes(a[0])),
    "recv_": ("p2p", lambda a: _nbytes(a[0])),
    "recv_any_source_": ("p2p", lambda a: _nbytes(a[0])),
    "alltoall_": ("all_to_all", lambda a: _nbytes(a[1])),
    "alltoall_base_": ("all_to_all", lambda a: _nbytes(a[1])),
    "reduce_": ("reduce", lambda a: _nbytes(a[0])),
    "gather_": ("gather", lambda a: _nbytes(a[1])),
    "scatter_": ("scatter", lambda a: _nbytes(a[0])),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_coalesced": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_out": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
}


class CommCounter(TorchDispatchMode):
    """Payload bytes and calls per kind of collective issued while active."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn itself into plain collectives first
        ns, name = func.namespace, func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else ""
        table = _C10D if ns == "c10d" else _FUNCTIONAL if ns == "_c10d_functional" else None
        if table is not None and name not in ("wait_tensor", "barrier", "monitored_barrier_", "_wrap_tensor_autograd"):
            kind, payload = table.get(name, (f"other:{name}", lambda a: _nbytes(a)))
            self.bytes[kind] += payload(args)
            self.calls[kind] += 1
        return func(*args, **(kwargs or {}))


def _activations_now(snapshot: dict) -> int:
    return sum(
        v
        for snap in snapshot.values()
        for key, v in snap.items()
        if getattr(key, "value", key) in ("Activation", "Temp")
    )


def replay_without_kept(events: list, alive: set) -> tuple[int, int]:
    """(peak of the activations and temporaries that the step also frees, bytes of those it keeps).
    MemTracker files a storage under the category of the first op that writes it: DDP's gradient
    buckets (persistent; under gradient_as_bucket_view they are the gradients) and FSDP's
    reduce-scatter outputs (the sharded gradients) would count as backward temporaries from their
    first write on. Storages still alive after the step are model states or buffers, which the
    plan counts as such, so the peak is replayed without them."""
    kept = {id(w): w.mem_consumed for w, _ in events if id(w) in alive}
    running = peak = 0
    for w, delta in events:
        if id(w) not in alive:
            running += delta
            peak = max(peak, running)
    return peak, sum(kept.values())


class _NoHook:
    """Stands for the gradient hooks torch's tracker would remove at exit, on a parameter that has none."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _FrozenParameters:
    """torch's tracker hooks every parameter's gradient, and a frozen one (LoRA's base, DPO's reference) refuses
    a hook: marked as hooked already, it is still counted as a parameter, its gradient never (it has none)."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def _memory_tracker(model, optimizer):
    """MemTracker (FSDPMemTracker for an FSDP2 root) that also keeps the peak of activations + temporaries."""
    from meshlm.compat import FSDPMemTracker, MemTracker  # torch.distributed._tools: seconds to import

    fsdp = isinstance(model, FSDPModule)
    base = FSDPMemTracker if fsdp else MemTracker

    class PeakActivations(_FrozenParameters, base):
        """A root module entered again in forward is the next micro-batch (pipeline schedules, gradient
        accumulation): MemTracker would take it for the next step and refuse. Its per-module stats are not used
        here (the peak comes from the global snapshot), so they start again: for a plain MemTracker in its
        pre-forward hook (global hooks, run before any module's); for FSDP2, whose tracker checks in the root's
        own FSDP pre-forward hook, in a hook registered in front of that one."""

        restart = None

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def __enter__(self):
            self.events = []  # (storage info, change of activations + temporaries) in order
            super().__enter__()
            if fsdp:  # after the tracker re-registered FSDP's hooks, so that prepend puts this one first
                self.restart = model.register_forward_pre_hook(self._next_micro_batch, prepend=True)
            return self

        def __exit__(self, *exc):
            if self.restart is not None:
                self.restart.remove()
            return super().__exit__(*exc)

        def _next_micro_batch(self, module, args):
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(module, None)

        def _update_snap(self, u_type, winfo, *a, **k):  # every change of the tracked memory passes here
            before = _activations_now(self._curr_mem_snap)
            super()._update_snap(u_type, winfo, *a, **k)
            if (now := _activations_now(self._curr_mem_snap)) != before:
                self.events.append((winfo, now - before))

        def step_peak(self) -> tuple[int, int]:
            return replay_without_kept(self.events, {id(w) for w, _ in self._WINFO.values()})

    if fsdp:
        return PeakActivations(model, optimizer)
    tracker = PeakActivations()
    tracker.track_external(model, optimizer)
    return tracker


class Probe:
    """`with Probe(engine, optimizer): <forward, backward, clip, optimizer step>`, then `save(out, step)`."""

    def __init__(self, engine, optimizer):
        self.engine, self.optimizer = engine, optimizer
        self.comm = CommCounter()
        self.mem = _memory_tracker(engine.model, optimizer)
        self.result: dict = {}

    def __enter__(self):
        self.cuda = self.engine.rt.device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_start = torch.cuda.memory_allocated()
        self.mem.__enter__()
        self.comm.__enter__()
        return self

    def __exit__(self, *exc):
        self.comm.__exit__(*exc)
        self.mem.__exit__(*exc)
        if exc[0] is not None:
            return False
        rt = self.engine.rt
        peak, kept = self.mem.step_peak()
        self.result = {
            "rank": rt.rank,
            "world_size": rt.world_size,
            "strategy": self.engine.name,
            "model_state_bytes": self.engine.model_state_bytes(self.optimizer),
            "activation_peak_bytes": peak,
            "kept_buffer_bytes": kept,
            "comm": {k: {"payload": self.comm.bytes[k], "calls": self.comm.calls[k]} for k in self.comm.bytes},
        }
        if self.cuda:
            torch.cuda.synchronize()
            self.result["cuda_step_peak_bytes"] = torch.cuda.max_memory_allocated() - self.cuda_start
        return False

    def save(self, out: Path, step: int) -> None:
        """<out>/probe/rank-R.json (the step is the one measured: --measure-step)."""
        path = out / "probe" / f"rank-{self.engine.rt.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.result, indent=1))
