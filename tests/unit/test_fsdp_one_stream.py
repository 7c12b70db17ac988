"""parallel/fsdp.py's collectives for CPU ranks (one stream), on a 1-rank gloo group: the in-place reduce-scatter
frees FSDP's input buffer once reduced (FSDP would keep it while the next block runs its backward: one unit
more at zero3's peak, as measured), except for `plan --simulate`'s fake ranks; the all-gather
blocks and hands FSDP a finished work, so FSDP frees its output at copy-out as for an async one, and gives the heap's
free pages back before it gathers (where a CPU rank peaks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.one_rank import one_rank_group
from meshlm import host_memory
from meshlm.parallel.fsdp import BlockingAllGather, InPlaceReduceScatter


@pytest.fixture(scope="module")
def group():
    with one_rank_group():
        yield dist.group.WORLD


@pytest.mark.parametrize("free_input", [True, False])
def test_the_reduce_scatter_frees_its_input_once_reduced(group, free_input):
    comm = InPlaceReduceScatter(free_input=free_input)
    grads = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    grads.copy_(torch.arange(6.0))
    out = torch.empty(6)
    assert comm(out, grads, group, dist.ReduceOp.AVG) is None
    assert torch.equal(out, torch.arange(6.0))
    assert grads.untyped_storage().nbytes() == (0 if free_input else 24)


def test_the_all_gather_returns_a_finished_work(group):
    comm = BlockingAllGather()
    out = comm.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    work = comm(out, torch.arange(4.0), group, async_op=True)
    assert torch.equal(out, torch.arange(4.0))  # gathered before it returns
    assert isinstance(work, dist.Work) and work.is_completed() and work.wait()


def test_the_all_gather_gives_back_the_free_heap_first(group, monkeypatch):
    """Before a unit of host_memory.GIVE_BACK_AT bytes or more; a smaller one is not worth the trim's time."""
    calls = []
    monkeypatch.setattr(host_memory, "_libc", lambda: type("Libc", (), {"malloc_trim": lambda _: calls.append(1)}))
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    comm = BlockingAllGather()
    for numel in (4, host_memory.GIVE_BACK_AT // 4):
        out = comm.allocate((numel,), dtype=torch.float32, device=torch.device("cpu"))
        comm(out, torch.ones(numel), group)
    assert calls == [1]  # the large one only
