"""host_memory: with glibc's mmap threshold fixed at 1 MiB while loading, weight-sized buffers freed under a live
allocation leave the process (without it, measured in a fresh process: 32 of these 32 MiB stay); after the first
step, keep_step_buffers keeps freed buffers in the heap for the next step (no page faults per step); give_back_free
returns the heap's free pages where a rank peaks."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from meshlm import host_memory

FREED = """
import torch
from meshlm import host_memory
def rss():  # anonymous memory only: library pages mapped in by the code under test are not buffers
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))
assert host_memory.return_freed_buffers()
big = torch.ones(16 * 2**20 // 4)  # freeing a 16 MiB mapping would raise glibc's dynamic threshold to 16 MiB
del big
before = rss()
blocks = [torch.ones(2**20) for _ in range(8)]  # 4 MiB each
keep = torch.ones(1000)  # allocated after them: on the heap it would pin the space below it
del blocks
assert keep.sum() == 1000
print(rss() - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_buffers_leave_the_process(monkeypatch):
    """In a process of its own: in the test worker, another test's threads and heap move the RSS it measures."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    grown = int(subprocess.run([sys.executable, "-c", FREED], capture_output=True, text=True, check=True).stdout)
    assert grown < 4 * 2**20


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not host_memory.return_freed_buffers()


STEPS = """
import resource, torch
from meshlm import host_memory
def faults_of_steps(mib):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        a = torch.ones(mib * 2**18)  # as a step's activation: allocated, written, freed
        del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
assert host_memory.return_freed_buffers()
loading = faults_of_steps(2)
# NF4 first, as a run sets it: freed 2 MiB chunks already in the heap (after the steady threshold) would serve
# the next ones whatever the threshold, since glibc maps a buffer only where its heap cannot hold it
assert host_memory.keep_step_buffers(True, nf4_weights=True)
faults_of_steps(2)
nf4 = faults_of_steps(2)
assert host_memory.keep_step_buffers(True)
faults_of_steps(2)  # the first one after the switch grows the heap
steady = faults_of_steps(2)
logits = faults_of_steps(16)
assert host_memory.keep_step_buffers(False)
faults_of_steps(16)
print(loading, steady, logits, nf4, faults_of_steps(16))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_steps_reuse_their_buffers_after_the_first(monkeypatch):
    """Under the loading threshold every 2 MiB buffer is mapped and faulted in again (512 pages each); after
    keep_step_buffers the heap keeps it, and the next allocation of that size faults in nothing. A 16 MiB buffer
    (the logits of 8 x 128 tokens of 4096 words) keeps its own mapping where the step makes weight-sized
    temporaries (4096 pages faulted each time), and is reused from the heap where it does not. Where those
    temporaries are NF4 weights (a quarter of their bf16 size) a 2 MiB buffer keeps its own mapping too."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True).stdout
    loading, steady, logits, nf4, whole = map(int, out.split())
    assert loading >= 10 * 512
    assert steady < 512
    assert logits >= 10 * 4096
    assert nf4 >= 10 * 512
    assert whole < 512


def test_the_users_own_setting_wins_after_the_first_step(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not host_memory.keep_step_buffers(True)


HELD_FREE = """
import torch
from meshlm import host_memory
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))
assert host_memory.return_freed_buffers()
# a unit's temporaries under the threshold, between the activations it keeps: freed, they stay in the heap
pairs = [(torch.ones(2**17), torch.ones(256)) for _ in range(64)]  # 512 KiB each, 32 MiB in all
kept = [k for _, k in pairs]
del pairs
before = rss()
assert host_memory.give_back_free(host_memory.GIVE_BACK_AT)
assert sum(k.sum() for k in kept) == 64 * 256
print(before - rss())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_free_heap_pages_are_given_back(monkeypatch):
    """64 freed buffers of 512 KiB (under the 1 MiB threshold: heap chunks), each below a small live one, hold 32
    MiB resident until give_back_free returns their pages; the live ones stay readable."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    out = subprocess.run([sys.executable, "-c", HELD_FREE], capture_output=True, text=True, check=True).stdout
    assert int(out) > 28 * 2**20


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_the_users_own_trimming_wins(monkeypatch, name):
    monkeypatch.setenv(name, "65536")
    assert not host_memory.give_back_free(host_memory.GIVE_BACK_AT)
