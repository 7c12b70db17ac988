"""Give freed tensor memory back to the system on CPU ranks (glibc's malloc).

PyTorch's CPU tensors come from malloc. glibc raises its mmap threshold to the size of the last
freed mapped block (up to 32 MiB), so after the first free most weight- and gradient-sized buffers
come from the heap instead, where one long-lived allocation above them (an optimizer state, a
gradient shard) keeps the freed space below it resident. Measured on 4 CPU ranks of a 160M Llama
(benchmarks/peak_memory.py): 270 MiB (zero3) and 560 MiB (fsdp 2 x tp 2) of a rank's peak RSS was
memory already freed. A fixed threshold gives every buffer of at least 1 MiB its own mapping, which
goes back to the system when it is freed.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
THRESHOLD = 1 << 20


def return_freed_buffers() -> bool:
    """Set glibc's mmap threshold to 1 MiB, unless the user set MALLOC_MMAP_THRESHOLD_; False if not glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
