"""glibc's malloc on CPU ranks: freed memory leaves the process while loading, step buffers stay afterwards.

PyTorch's CPU tensors come from malloc. glibc raises its mmap threshold to the size of the last freed
mapped block (up to 32 MiB), so after the first free most weight- and gradient-sized buffers come from
the heap, where one long-lived allocation above them (an optimizer state, a gradient shard) keeps the
freed space below it resident. So start-up, loading and the first step run with the threshold fixed at
1 MiB: every buffer of at least 1 MiB has its own mapping, which goes back to the system when freed.
Measured on 4 CPU ranks of a 160M Llama (benchmarks/peak_memory.py): 270 MiB (zero3) and 560 MiB
(fsdp 2 x tp 2) of a rank's peak RSS was memory already freed.

Kept for every step, the same threshold makes each step map, fault in (zero-fill) and unmap every
activation again: 30% of the CPU step (measured: BENCHMARKS.md). After the first step, what is free is
trimmed once (`malloc_trim`), and from then on a step's buffers come from the heap and stay there: the working
set of one step is the working set of the next. Up to 4 MiB where a step also frees weight-sized buffers
(gradients set to None, FSDP's gathered weights, foreach AdamW's copies), which would fragment the heap (a
pipeline stage's peak rose 8% at 32 MiB); under DDP, whose gradients stay in its buckets, up to 32 MiB, the
ceiling of glibc's own dynamic threshold (what a program that leaves glibc alone gets): the logits of short
blocks (8 x 128 tokens of a 4096-word vocabulary: 16 MiB, three such buffers a step) are reused, not faulted in
again.

What the heap holds free is still resident: a unit's temporaries under the threshold (activations' gradients,
attention's scratch, NF4's dequantising chunks) freed between the saved activations, where the next unit's do not
always fit. Where a zero3 CPU rank peaks (gloo's all-gather of the next unit: plan/memory.py gloo_gathering) those
pages are given back first, where the unit is large enough for the trim to pay (`give_back_free`, parallel/fsdp.py
BlockingAllGather). Measured on 4 ranks of QLoRA's
160M zero3 job (benchmarks/suites.py lora-nf4-base-rss; glibc's mallinfo2, and malloc_trim at the peak): the
heap's live bytes and mapped blocks were the planner's peak within 1 MiB, beside 25 MiB (NF4 base) and 37 MiB
(bf16 base) of free heap pages that malloc_trim gave back; about 2 ms a call, 33 calls a step.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
LOADING = 1 << 20
STEADY = 4 << 20  # after the first step, where weight-sized buffers come and go each step: activation-sized
# buffers are reused from the heap; larger ones (a gathered weight) keep their own mapping. 1 GiB was 5% faster
# still but raised zero3 x4's peak from 0.38 to 0.69 of one process: weight-sized gathers fragment the heap
STEADY_NF4 = LOADING  # under --lora.quantize nf4, whose gathered weights are a quarter of their bf16 size: in the
# heap below 4 MiB they stayed among the activations and its free part grew each step (rss_phases: +20 MiB in 4 steps)
STEADY_WHOLE = 32 << 20  # after the first step where no weight-sized buffer is freed (DDP, fused AdamW)
KEEP_TOP = 1 << 30  # trim threshold: the heap's top is not given back (and faulted in again) every step
GIVE_BACK_AT = 4 << 20  # a trim walks the heap (~2 ms on the 160M job): before each sub-MiB unit of the default
# model's zero3 it cost 30% of the step's tokens/s; units this size take far longer to gather and compute


@functools.cache
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


def steady(nf4_weights: bool) -> int:
    """The mmap threshold after the first step where a step makes weight-sized temporaries."""
    return STEADY_NF4 if nf4_weights else STEADY


def keep_step_buffers(weight_sized_temporaries: bool, nf4_weights: bool = False) -> bool:
    """After the first step: give back what is free now, then keep freed buffers for the next step's reuse (up to
    STEADY where the step makes weight-sized temporaries, STEADY_NF4 where those are NF4 weights, else
    STEADY_WHOLE).

    Unless the user set glibc's thresholds; False if not glibc.
    """
    libc = _libc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc.malloc_trim(0)
    kept = bool(libc.mallopt(M_MMAP_THRESHOLD, steady(nf4_weights) if weight_sized_temporaries else STEADY_WHOLE))
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:  # else the heap's top is given back and faulted in each step
        kept = bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_TOP)) and kept
    return kept


def give_back_free(gathering: int) -> bool:
    """Give the heap's free pages back to the system now (malloc_trim), before gathering a unit of `gathering`
    bytes: only for units of GIVE_BACK_AT and more, and unless the user set glibc's thresholds, whose trimming is
    then theirs; False where it did not."""
    libc = _libc()
    if gathering < GIVE_BACK_AT or libc is None:
        return False
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & os.environ.keys():
        return False
    libc.malloc_trim(0)
    return True
