"""Waiting for work only rank 0 does (tokenising a corpus, loading weights) without a collective's timeout.

A barrier would bound that wait by --dist-timeout, and NCCL's watchdog aborts the process when it
expires, however healthy rank 0 is. Instead rank 0 (and, for node-local work, each node's first
rank) sets a key in the job's store when its block is done, or failed, and bumps a heartbeat
counter every HEARTBEAT_S seconds from a thread for as long as its process lives. The others wait
on the key in the store (waking as soon as it is set): they go on when it says done, fail at once
when it says failed, and fail when the heartbeat has not moved for the bound (--dist-timeout):
rank 0 is then gone or frozen.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import threading
import time

import torch.distributed as dist

from meshlm import compat
from meshlm.errors import MeshlmError

HEARTBEAT_S = 2.0
USAGE = "usage:"  # the outcome of a block that stopped on bad input: the error's line follows
POLL_S = 1.0  # the longest a waiting rank goes without looking at the heartbeat
_calls = itertools.count()  # every rank makes the same rank0_first calls in the same order
_beat: tuple[threading.Thread, threading.Event] | None = None


def _store():
    return compat.default_store()


def _beat_key(leader: int) -> str:
    return f"meshlm/rank0/heartbeat/{leader}"


def start_heartbeat(rank: int, local_rank: int) -> None:
    """On rank 0 and on every node's first rank: bump a counter in the store until stop_heartbeat."""
    global _beat
    if local_rank != 0 or _beat is not None:
        return
    store, key, stop = _store(), _beat_key(rank), threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            try:
                store.add(key, 1)
            except RuntimeError:  # the store's host went away: the job is ending
                return

    store.add(key, 1)
    thread = threading.Thread(target=beat, name="meshlm-heartbeat", daemon=True)
    thread.start()
    _beat = (thread, stop)


def stop_heartbeat() -> None:
    """Stop and join the heartbeat thread, so no thread of ours touches the store after the group is gone."""
    global _beat
    if _beat is not None:
        thread, stop = _beat
        stop.set()
        thread.join()
        _beat = None


def next_key(leader: int) -> str:
    """Unique per call and per attempt: plain torchrun keeps the store across restarts (--max-restarts),
    where an earlier attempt's "done" or "failed" must not answer for this one."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"meshlm/rank0/{attempt}/{next(_calls)}/{leader}"


@contextlib.contextmanager
def announce(key: str):
    """Rank 0's side: run the block, then tell the others whether it succeeded."""
    try:
        yield
    except MeshlmError as e:  # bad input (a record of the dataset): every rank stops with the same line
        _store().set(key, f"{USAGE}{e}")
        raise
    except BaseException:
        _store().set(key, "failed")
        raise
    _store().set(key, "done")


def _done(store, key: str, leader: int, what: str) -> bool:
    """Wait up to POLL_S for `key`: True as soon as it is set, False after POLL_S."""
    try:
        store.wait([key], datetime.timedelta(seconds=POLL_S))
        return True
    except dist.DistNetworkError:  # rank 0 hosted the store (plain env:// start) and is gone
        raise RuntimeError(f"rank {leader} is gone (its store closed) during {what}; see its log") from None
    except RuntimeError:  # the wait timed out (DistStoreError): look at the heartbeat
        return False


def wait_for(key: str, leader: int, what: str, bound_s: float) -> None:
    """The others' side: return once `leader` is done; raise if it failed or its heartbeat stopped for bound_s."""
    store, beat = _store(), _beat_key(leader)
    last, since = None, time.monotonic()
    while not _done(store, key, leader, what):
        count = store.add(beat, 0)
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since > bound_s:
            raise RuntimeError(
                f"rank {leader} stopped responding during {what}: no heartbeat for "
                f"{bound_s:.0f} s (--dist-timeout); see its log"
            )
    outcome = store.get(key).decode(errors="replace")
    if outcome.startswith(USAGE):
        raise MeshlmError(outcome[len(USAGE) :])
    if outcome == "failed":
        raise RuntimeError(f"rank {leader} failed during {what} (its error is the cause)")
