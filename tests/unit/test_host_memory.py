"""host_memory.return_freed_buffers: with glibc's mmap threshold fixed at 1 MiB, weight-sized buffers freed under
a live allocation leave the process (without it, measured in a fresh process: 32 of these 32 MiB stay)."""

from __future__ import annotations

import platform

import pytest
import torch

from meshlm import host_memory


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_buffers_leave_the_process(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert host_memory.return_freed_buffers()
    big = torch.ones(16 * 2**20 // 4)  # freeing a 16 MiB mapping would raise glibc's dynamic threshold to 16 MiB
    del big
    before = _rss()
    blocks = [torch.ones(2**20) for _ in range(8)]  # 4 MiB each
    keep = torch.ones(1000)  # allocated after them: on the heap it would pin the space below it
    del blocks
    assert _rss() - before < 4 * 2**20
    assert keep.sum() == 1000


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not host_memory.return_freed_buffers()
