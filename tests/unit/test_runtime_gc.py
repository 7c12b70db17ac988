"""runtime.freeze_imports: what a process holds when it starts a job (its imported modules) leaves the garbage
collector's view once per process, so full collections skip it; what the job makes later stays collectable."""

from __future__ import annotations

import gc
import weakref

from meshlm import host_memory, runtime


class _Node:
    pass


def _garbage_cycle() -> weakref.ref:
    """A reference cycle nothing points to: only a collection of its generation frees it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_freezes_once_per_process(monkeypatch):
    monkeypatch.setattr(runtime, "_frozen_in", 0)  # as a process that has not started a job
    gc.disable()  # no automatic collection may free the first cycle before the freeze
    try:
        before = _garbage_cycle()
        runtime.freeze_imports()
    finally:
        gc.enable()
    assert gc.get_freeze_count() > 1000  # this worker's modules and classes, and the cycle made before
    gc.collect()
    assert before() is not None  # frozen: a full collection no longer looks at it
    after = _garbage_cycle()
    runtime.freeze_imports()  # a second job in the same process freezes nothing more
    gc.collect()
    assert after() is None


def test_every_job_freezes_when_it_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "freeze_imports", lambda: calls.append(1))
    monkeypatch.setattr(host_memory, "return_freed_buffers", lambda: False)  # leave this worker's malloc alone
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    runtime.init("gloo", want_cuda=False)
    assert calls == [1]
