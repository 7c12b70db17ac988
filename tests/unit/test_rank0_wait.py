"""The waiting side of rank-0-first work, on an in-process store: done, failed, and a silent rank 0."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from meshlm import rank0_wait


@pytest.fixture
def store(monkeypatch):
    s = dist.HashStore()
    monkeypatch.setattr(rank0_wait, "_store", lambda: s)
    monkeypatch.setattr(rank0_wait, "POLL_S", 0.1)
    return s


def test_waits_past_the_bound_while_the_heartbeat_moves(store):
    """Rank 0 works 1.5 s with a 0.5 s bound: its heartbeat keeps the others waiting, then they go on."""

    def rank0():
        with rank0_wait.announce("k"):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                store.add(rank0_wait._beat_key(0), 1)
                time.sleep(0.1)

    threading.Thread(target=rank0).start()
    t0 = time.monotonic()
    rank0_wait.wait_for("k", 0, "the work", bound_s=0.5)
    assert time.monotonic() - t0 >= 1.0


def test_failure_reaches_the_others_at_once(store):
    with pytest.raises(ValueError), rank0_wait.announce("k"):
        raise ValueError("tokeniser broke")
    with pytest.raises(RuntimeError, match="rank 0 failed during the work"):
        rank0_wait.wait_for("k", 0, "the work", bound_s=60)


def test_a_silent_rank0_fails_after_the_bound(store):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 stopped responding during the work: no heartbeat for 1 s"):
        rank0_wait.wait_for("k", 0, "the work", bound_s=1)
    assert 1 <= time.monotonic() - t0 < 10
