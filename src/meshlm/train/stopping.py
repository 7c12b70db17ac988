"""Stopping between two steps on SIGINT/SIGTERM (Ctrl-C, `kill`, a preempted Slurm job), on every rank at once.

The first signal only raises a flag; a second one (more than a second later: the launcher passes the signal on
to ranks that may have had it already) stops the process at once. Ranks must stop after the same step, or the
ones that go on wait in a collective for the ones that left, so each step all-reduces the flag (MAX over every
rank) without waiting for it, and the next step reads the result: by then it is long done, and every rank
reads the same value after the same step. A signal that reaches one rank only stops them all.

Under a launcher (meshlm's or torchrun) only SIGINT is taken this way: the launcher stops the ranks of a failed
job with SIGTERM, and they must die at once, dumping their stacks (runtime.dump_stacks_on_signal); meshlm's
launcher passes a SIGTERM it receives on as SIGINT. One process takes both.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from meshlm.errors import MeshlmError
from meshlm.runtime import Runtime, log

REPEAT_S = 1.0  # a second signal sooner than this is the same request arriving twice


class StopOnSignal:
    """A context manager around the training loop; `agreed()` after each step returns the signal to stop for."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.signum, self.since = 0, 0.0
        self._pending = None  # (flag tensor, all-reduce work) of the last step
        self._previous = {}

    def __enter__(self) -> StopOnSignal:
        launched = "TORCHELASTIC_RUN_ID" in os.environ  # set by torchelastic in every rank it starts
        signals = (signal.SIGINT,) if launched else (signal.SIGINT, signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():  # Python only lets the main thread set them
            self._previous = {s: signal.signal(s, self._handle) for s in signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._pending is not None:  # never leave a collective in flight behind the loop
            self._pending[1].wait()
            self._pending = None

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum and now - self.since > REPEAT_S:
            raise KeyboardInterrupt  # asked twice: stop now, wherever this is
        if not self.signum:
            self.signum, self.since = signum, now
            log.warning(
                f"{signal.Signals(signum).name}: stopping after this step (again to stop at once)",
                extra={"console": False},
            )

    def agreed(self) -> int:
        """The signal every rank stops for after this step (0: go on). Called once per step on every rank."""
        if not dist.is_initialized():
            return self.signum
        flag = torch.tensor(self.signum, dtype=torch.int32, device=self.rt.device)
        previous, self._pending = self._pending, (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        if previous is None:
            return 0
        previous[1].wait()
        return int(previous[0].item())


def after_nonfinite(cfg, step: int, skipped: int) -> None:
    """A step whose loss or gradients are NaN/inf is skipped (no optimizer update) while --skip-nonfinite allows;
    past that the run stops."""
    if skipped > cfg.skip_nonfinite:
        allowed = f"skipped {skipped - 1}, --skip-nonfinite allows {cfg.skip_nonfinite}"
        raise MeshlmError(
            f"loss or gradients are not finite at step {step} ({allowed}); lower --lr, "
            f"or allow skipping such steps with --skip-nonfinite N"
        )
    log.warning(
        f"step {step}: loss or gradients are not finite; skipped the update "
        f"({skipped} of --skip-nonfinite {cfg.skip_nonfinite})"
    )
