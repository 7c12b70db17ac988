"""glibc's malloc on CPU ranks: freed memory leaves the process while loading, step buffers stay afterwards.

PyTorch's CPU tensors come from malloc. glibc raises its mmap threshold to the size of the last freed
mapped block (up to 32 MiB), so after the first free most weight- and gradient-sized buffers come from
the heap, where one long-lived allocation above them (an optimizer state, a gradient shard) keeps the
freed space below it resident. So start-up, loading and the first step run with the threshold fixed at
1 MiB: every buffer of at least 1 MiB has its own mapping, which goes back to the system when freed.
Measured on 4 CPU ranks of a 160M Llama (benchmarks/peak_memory.py): 270 MiB (zero3) and 560 MiB
(fsdp 2 x tp 2) of a rank's peak RSS was memory already freed.

Kept for every step, the same threshold makes each step map, fault in (zero-fill) and unmap every
activation again: 30% of the CPU step (BENCHMARKS.md section 14). After the first step, what is free is
trimmed once (`malloc_trim`), and from then on buffers up to 4 MiB come from the heap and stay there: the
working set of one step is the working set of the next.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
LOADING = 1 << 20
STEADY = 4 << 20  # after the first step: activation-sized buffers are reused from the heap; larger ones
# (a gathered weight, the logits) keep their own mapping. 1 GiB was 5% faster still but raised zero3 x4's peak
# from 0.38 to 0.69 of one process: weight-sized gathers fragment the heap (BENCHMARKS.md section 14)
KEEP_TOP = 1 << 30  # trim threshold: the heap's top is not given back (and faulted in again) every step


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_freed_buffers() -> bool:
    """Set glibc's mmap threshold to 1 MiB, unless the user set MALLOC_MMAP_THRESHOLD_; False if not glibc."""
    libc = _libc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, LOADING))


def keep_step_buffers() -> bool:
    """After the first step: give back what is free now, then keep freed buffers for the next step's reuse.

    Unless the user set glibc's thresholds; False if not glibc.
    """
    libc = _libc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc.malloc_trim(0)
    kept = bool(libc.mallopt(M_MMAP_THRESHOLD, STEADY))
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:  # else the heap's top is given back and faulted in each step
        kept = bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_TOP)) and kept
    return kept
