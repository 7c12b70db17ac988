"""A deliberately broken data-parallel layout for tests/test_verify.py: with this directory on PYTHONPATH, every
DistributedDataParallel in the process leaves the final norm's gradient out of its all-reduce (DDP's own list of
parameters to ignore), so each rank steps that tensor with its own micro-batch's gradient. One process (no DDP)
is untouched."""

import torch.nn.parallel

UNREDUCED = "model.norm.weight"
_init = torch.nn.parallel.DistributedDataParallel.__init__


def _leave_one_gradient_local(self, module, *args, **kwargs):
    module._ddp_params_and_buffers_to_ignore = [UNREDUCED]
    _init(self, module, *args, **kwargs)


torch.nn.parallel.DistributedDataParallel.__init__ = _leave_one_gradient_local
