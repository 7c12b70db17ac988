"""DistributedDataParallel on fake tensors, for `meshlm plan --simulate` (ddp, zero1, their pipeline stages).

torch's own DDP is built as meshlm builds it (parallel/ddp.py `replicate`, master_weights' zero1): its C++
reducer lays out the gradient buckets from the parameters' sizes (25 MiB each, the first 1 MiB), allocates
them through the dispatcher (so under FakeTensorMode they are fake: shapes, no memory), makes each gradient
a view of its bucket (gradient_as_bucket_view) and copies gradients in during backward. Two of its steps
need values, not sizes, and are replaced while the simulation runs:

- the construction-time check that every rank has the same parameter shapes: a C++ collective over the
  shapes written into a real buffer (every simulated rank builds the same model, so nothing to check);
- the bucket all-reduce: the fake process group's work carries no result, which the C++ reducer needs. A
  comm hook that returns the bucket itself stands in for it: DDP's default hook divides and all-reduces
  the bucket in place and returns it, so the memory is the same (fake collectives move nothing anyway).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.parallel.distributed as ddp_module


def _bucket_done(state, bucket):  # no annotations: DDP checks them as objects, not strings
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


@contextlib.contextmanager
def fake_reducer():
    """While active, every DDP built runs its reducer without reading values (see the module docstring)."""
    DDP = ddp_module.DistributedDataParallel
    real_init, real_verify = DDP.__init__, ddp_module._verify_param_shape_across_processes

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.register_comm_hook(None, _bucket_done)

    DDP.__init__ = init
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        DDP.__init__, ddp_module._verify_param_shape_across_processes = real_init, real_verify
