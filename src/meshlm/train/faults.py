"""Fault injection: testing aids for the crash, restart and hang paths, off unless their variable is set (a rank
imports this module only then: runtime.FAULT_VARIABLES).

They exist so that tests (and anyone checking a cluster setup) can make one rank of
a real multi-process job misbehave at a chosen step. Steps count from 1. A step may
be written N@A to act only in attempt A of an elastic job (0 = the first start,
1 = after the first restart, ...); plain N means attempt 0, so that a restart
(--max-restarts) recovers from the fault.

  MESHLM_FAIL_AT_STEP=N [MESHLM_FAIL_RANK=R]    rank R (default 0) raises inside step N, after the backward
                                                and before the optimizer step
  MESHLM_STALL_AT_STEP=N [MESHLM_STALL_RANK=R]  rank R sleeps inside step N until it is killed: a hang
                                                that --dist-timeout must turn into a failure
  MESHLM_STEP_SLEEP=S                           every rank sleeps S seconds inside each step: a run that is
                                                still training while a test signals it, however loaded the
                                                machine
  MESHLM_NONFINITE_STEPS=N[,M...]               every rank's loss and gradients become NaN at those steps,
                                                as an overflow would (see --skip-nonfinite)
  MESHLM_PAUSE_IN_SAVE=N                        every rank sleeps inside the save of step N, after the shards
                                                are written and before the COMPLETE marker: the moment to kill
  MESHLM_FAIL_IN_LOAD=R                         rank R raises while resuming, after reading its shards (as an
                                                out-of-memory error would): not a corrupt checkpoint
"""

from __future__ import annotations

import os
import time

import torch

from meshlm.runtime import log


def _at(var: str, step: int, rank: int | None = None, rank_var: str = "") -> bool:
    """Whether the variable names this step (in this attempt) and, with rank_var, this rank."""
    value = os.environ.get(var)
    if not value:
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # set by torchelastic in every rank
    wanted = {item if "@" in item else f"{item}@0" for item in value.replace(" ", "").split(",")}
    if f"{step}@{attempt}" not in wanted:
        return False
    return rank is None or int(os.environ.get(rank_var, "0")) == rank


def in_step(step: int, rank: int, loss: torch.Tensor, params) -> torch.Tensor:
    """The step's loss, after failing, stalling or slowing down this rank inside `step` when asked to (or made NaN
    with its gradients: `nonfinite`)."""
    loss = nonfinite(step, loss, params)
    pause = os.environ.get("MESHLM_STEP_SLEEP")
    if pause:
        time.sleep(float(pause))
    if _at("MESHLM_FAIL_AT_STEP", step, rank, "MESHLM_FAIL_RANK"):
        raise RuntimeError(f"injected fault at step {step} on rank {rank} (MESHLM_FAIL_AT_STEP)")
    if _at("MESHLM_STALL_AT_STEP", step, rank, "MESHLM_STALL_RANK"):
        log.warning(f"rank {rank} (pid {os.getpid()}) stalls at step {step} (MESHLM_STALL_AT_STEP)")
        while True:
            time.sleep(1)
    return loss


def nonfinite(step: int, loss: torch.Tensor, params) -> torch.Tensor:
    """The loss, made NaN together with every gradient when MESHLM_NONFINITE_STEPS names this step."""
    if not _at("MESHLM_NONFINITE_STEPS", step):
        return loss
    for p in params:
        if p.grad is not None:
            p.grad.fill_(float("nan"))
    return loss * float("nan")


def pause_in_save(step: int) -> None:
    if _at("MESHLM_PAUSE_IN_SAVE", step):
        log.warning(f"pausing inside the save of step {step} (MESHLM_PAUSE_IN_SAVE)")
        while True:
            time.sleep(1)


def in_load(rank: int) -> None:
    value = os.environ.get("MESHLM_FAIL_IN_LOAD")
    if value and int(value) == rank:
        raise RuntimeError(f"injected fault while loading a checkpoint on rank {rank} (MESHLM_FAIL_IN_LOAD)")
