"""Stand-ins for the few steps of torch's distributed code that read values, for `meshlm plan --simulate`.

Everything else runs as `meshlm train` runs it, on fake tensors (shapes, no memory):

- Filling the weights: nothing is filled (shapes_only); every module gets fake storage afterwards, as
  meta-device initialisation does.
- DistributedDataParallel (ddp, zero1, DDP-replicated pipeline stages) is torch's own (SimulatedDDP), built as meshlm
  builds it: its C++ reducer lays out the gradient buckets from the parameters' sizes (25 MiB each, the first 1 MiB),
  allocates them through the dispatcher (so they are fake), makes each gradient a view of its bucket
  (gradient_as_bucket_view) and copies gradients in during backward. Two steps need values: the check at construction
  that every rank has the same parameter shapes (a C++ collective over a buffer of the shapes; every simulated rank
  builds the same model) is skipped, and the bucket all-reduce, whose fake work carries no result for the reducer, is
  a comm hook that returns the bucket itself: DDP's default hook divides and all-reduces the bucket in place and
  returns it, so the memory is the same. From the second step on, the buckets are not rebuilt in backward's order (see
  _FirstBuckets).
- A mixture of experts' grouped matmul (transformers' grouped_mm experts): torch's fake kernel of grouped_mm
  takes only bf16 (the CUDA kernel's rule), where meshlm also runs fp32 parameters (fp32, and bf16 autocast
  over fp32 masters); the stand-in allocates what the kernel would (the output, and in backward the input and
  weight gradients) in the weights' dtype (grouped_experts_by_shapes). Which rows go to which expert is the
  balanced router's of parallel/expert.py ROUTING. transformers offers no public way to choose the matmul
  inside its grouped experts (its ExpertsInterface chooses the whole forward), and a torch function mode would
  miss the recomputed forward of activation checkpointing (it is inactive inside autograd.backward), so
  compat_transformers.grouped_mm_replaced swaps transformers' private _grouped_mm while a rank is simulated.

The first two reach training through parallelize's one seam (SIMULATED, a parallel/apply.py Standins); the third
swaps an attribute inside compat_transformers.py (docs/plan.md lists every attribute the simulation swaps).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.compat import ddp_without_shape_check
from meshlm.layout import REPLICATED
from meshlm.parallel.apply import Standins


def reads_values_when_built(layout) -> bool:
    """Whether building the layout's engine reads its parameters' values, so that the simulation gives them
    fake storage first: DDP broadcasts rank 0's (the ddp and zero1 strategies, built so even where a single
    data-parallel rank wraps nothing), and the "masters" engine copies them into fp32 masters."""
    return layout.engine == "masters" or layout.strategy in REPLICATED


def _bucket_done(state, bucket):  # no annotations: DDP checks them as objects, not strings
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class _FirstBuckets:
    """DDP's reducer, keeping the buckets of its first step. In its second step DDP rebuilds them in the order
    backward produced the gradients, after agreeing on that order across ranks through a broadcast it reads;
    the new buckets hold the same gradients (the same total size), and the trainer's measured step is a later
    one, past the rebuild."""

    def __init__(self, reducer):
        self._reducer = reducer

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


class SimulatedDDP(DDP):
    """DistributedDataParallel as meshlm builds it (parallelize's `ddp`), standing in for the steps that read
    values (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        with ddp_without_shape_check():
            super().__init__(*args, **kwargs)
        self.register_comm_hook(None, _bucket_done)
        self.reducer = _FirstBuckets(self.reducer)


class _GroupedMatmul(torch.autograd.Function):
    """x (S, in) @ w (E, in, out) grouped by offsets -> (S, out), by shapes alone."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w)
        return x.new_empty(x.shape[0], w.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), None


@contextlib.contextmanager
def grouped_experts_by_shapes():
    """While active, transformers' grouped experts run their matmuls by shapes (see the module docstring)."""
    from meshlm.compat_transformers import grouped_mm_replaced

    with grouped_mm_replaced(lambda x, w, offs: _GroupedMatmul.apply(x.to(w.dtype), w, offs)):
        yield


def shapes_only(*args, **kwargs) -> None:
    """The simulation's `fill`: no values; every module gets fake storage afterwards (see the module docstring)."""


SIMULATED = Standins(fill=shapes_only, ddp=SimulatedDDP)
