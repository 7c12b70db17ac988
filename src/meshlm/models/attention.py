"""Which attention kernel a model runs (--attention), and meshlm's document-aware kernels for packed blocks.

A packed block restarts its position ids at each document. transformers turns that into a dense
[B, 1, S, S] block-diagonal mask for SDPA, which computes every score of the block and masks most of
them (and repeats the key/value heads of grouped-query attention whenever there is a mask). meshlm's kernels:

- flex: transformers' own FlexAttention path; its mask interface builds one BlockMask per forward
  from the packed position ids (create_block_mask, compiled once per shape), and every layer reuses it.
  GPUs only: FlexAttention has no backward on CPU.
- varlen: documents as variable-length sequences, no mask tensor. On CUDA transformers' flash-attention
  path (cumulative sequence lengths from the position ids); elsewhere `document_attention` below, causal
  SDPA per run of documents, registered through transformers' attention interface as "meshlm_varlen".
- auto on CPU below CPU_DOCUMENTS_FROM tokens: `masked_attention` ("meshlm_sdpa"), one SDPA call per layer with
  an additive document mask made once per forward, the key/value heads shared in the kernel: on short blocks
  the documents fill most of the causal triangle and one call costs less than one per run.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from meshlm import compat
from meshlm.compat_transformers import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    flash_attention_mask,
    sdpa_attention_forward,
    sdpa_mask,
)
from meshlm.errors import MeshlmError
from meshlm.models import families

DOCUMENTS = "meshlm_varlen"
MASKED = "meshlm_sdpa"


def document_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """Each row's document lengths: a document starts where the position does not follow the previous one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    seq = position_ids.shape[1]
    lengths = []
    for row in starts.tolist():
        first = [i for i, s in enumerate(row) if s] + [seq]
        lengths.append([b - a for a, b in zip(first, first[1:])])
    return lengths


class Plan:
    """The micro-batch's documents in token order, as runs of equal length: `runs[i]` = (documents, length).

    A run of n documents of L tokens is one contiguous slice of the flattened [B*S] tokens, so it is viewed as n
    sequences of L and given to causal SDPA as they lie: no gather, no padding, no mask, the key/value heads
    shared in the kernel. Rows that are one document each (the common case of short blocks) are one run, one
    call. The outputs are concatenated in token order: one copy forward (as SDPA's own output transpose), one
    per input backward (the split's).
    """

    def __init__(self, position_ids: torch.Tensor, batch: int):
        runs: list[list[int]] = []
        for row in document_lengths(position_ids.expand(batch, -1)):
            for length in row:
                if runs and runs[-1][1] == length:
                    runs[-1][0] += 1
                else:
                    runs.append([1, length])
        self.runs = [(n, length) for n, length in runs]

    def run(self, query, key, value, dropout: float, scaling) -> torch.Tensor:
        """[B, H, S, D] queries, [B, Hkv, S, D] keys and values -> [B, S, H, D], causal within each document."""
        b, h, s, d = query.shape
        sizes = [n * length for n, length in self.runs]
        pieces = [t.transpose(1, 2).reshape(b * s, t.shape[1], d).split(sizes) for t in (query, key, value)]
        outs = []
        for (n, length), q, k, v in zip(self.runs, *pieces):
            q, k, v = (t.view(n, length, t.shape[1], d).transpose(1, 2) for t in (q, k, v))
            o = _sdpa(q, k, v, None, dropout, scaling)
            outs.append(o.transpose(1, 2).reshape(n * length, h, d))
        return torch.cat(outs).view(b, s, h, d)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' boolean mask (True: seen) as SDPA's additive one, made once per forward rather than by SDPA
    in every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _sdpa(query, key, value, mask, dropout: float, scaling) -> torch.Tensor:
    """Causal SDPA (or SDPA with `mask`), the key/value heads shared inside the kernel (enable_gqa).

    transformers' SDPA path repeats the key and value heads whenever a mask is given (repeat_kv: a copy of each
    per layer, a sum backward): on CPU at 128 tokens that made the document mask slower than plain causal SDPA.
    """
    gqa = key.shape[1] != query.shape[1]
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None, enable_gqa=gqa
    )


class _PerForward:
    """What every layer of one forward shares (a Plan, an additive mask), made at its first layer: the same
    tensor (position ids, transformers' mask) reaches every layer, so it is the key."""

    def __init__(self):
        self.make, self.tensor, self.made = None, None, None

    def of(self, make, tensor: torch.Tensor, *args):
        """make(tensor, *args), once per forward."""
        if make is not self.make or tensor is not self.tensor:
            self.make, self.tensor, self.made = make, tensor, make(tensor, *args)
        return self.made


_per_forward = _PerForward()


def _defer(query, key) -> bool:
    """A cache (decoding, prefill after a prefix) goes to transformers' SDPA path."""
    return query.shape[2] != key.shape[2] or query.shape[2] == 1


def document_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal SDPA within each packed document ([B, H, S, D] in, [B, S, H, D] out as transformers' kernels).

    A padding mask (generate), a cache or fake tensors (meshlm plan --simulate: shapes without the positions'
    values) go to transformers' SDPA path.
    """
    position_ids = kwargs.get("position_ids")
    documents = position_ids is not None and not isinstance(position_ids, compat.FakeTensor)
    if attention_mask is not None or not documents or _defer(query, key):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    plan = _per_forward.of(Plan, position_ids, query.shape[0])
    return plan.run(query, key, value, dropout, scaling), None


def masked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA path with its own mask (the packed documents' block-diagonal mask, sdpa_mask; None where
    plain causal attention is exact), one SDPA call per layer, the key/value heads shared in the kernel."""
    if _defer(query, key) or (attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if attention_mask is not None and not torch.compiler.is_compiling():  # compiled, Inductor fuses it
        attention_mask = _per_forward.of(additive, attention_mask, query.dtype)
    return _sdpa(query, key, value, attention_mask, dropout, scaling).transpose(1, 2), None


def _document_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed training blocks (the kernel reads the position ids); generate's padding mask as SDPA's."""
    if attention_mask is not None and not bool(attention_mask.all()):
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    return flash_attention_mask(*args, attention_mask=None, **kwargs)


AttentionInterface.register(DOCUMENTS, document_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DOCUMENTS, _document_mask)
AttentionInterface.register(MASKED, masked_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(MASKED, sdpa_mask)


def _sliding(config) -> bool:
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _plain(config) -> str:
    """Why a per-document causal SDPA would not compute this family's attention exactly ("" if it does)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "soft-capped scores"
    if _sliding(config):
        return "a sliding window"
    return "attention sinks" if getattr(config, "sinks", False) else ""


CPU_DOCUMENTS_FROM = 256  # sequence length from which documents one by one beat one masked call on CPU
# (benchmarks/attention.py: at 128 the extra SDPA calls of the runs cost more than they skip)


def implementation(choice: str, config, cuda: bool, seq_length: int) -> str:
    """transformers' attn_implementation for --attention `choice` (MeshlmError if it cannot run here)."""
    family = getattr(config, "model_type", "this model")
    base = families.attention(config)  # sdpa, or eager where the family has none
    cls = families.model_class(config)
    has_flex = cls is None or getattr(cls, "_supports_flex_attn", False)
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    exact = base == "sdpa" and not _plain(config) and families.supports_attention_interface(config)
    if choice == "auto":
        if cuda:  # flex joins auto's choices once make gpu-check has measured it (not yet measured on a GPU)
            return "flash_attention_2" if flash and exact else base
        if not exact:
            return base
        return DOCUMENTS if seq_length >= CPU_DOCUMENTS_FROM else MASKED
    if choice == "sdpa":
        return base
    if choice == "flex":
        if not cuda:
            raise MeshlmError(
                "--attention flex: meshlm runs FlexAttention on CUDA only (on CPU it has no backward); "
                "use --attention varlen or sdpa"
            )
        if not has_flex:
            raise MeshlmError(f"--attention flex: {family} has no FlexAttention path; use --attention sdpa")
        return "flex_attention"
    if not exact:
        why = _plain(config) or (
            "no SDPA path" if base != "sdpa" else "its own code, not transformers' attention interface"
        )
        raise MeshlmError(f"--attention varlen: {family}'s attention has {why}; use --attention flex or sdpa")
    if cuda and not flash:
        raise MeshlmError("--attention varlen on CUDA needs the flash-attn package; install it or use --attention flex")
    return "flash_attention_2" if cuda else DOCUMENTS
