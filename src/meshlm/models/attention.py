"""Which attention kernel a model runs (--attention), and meshlm's document-wise kernel for packed blocks.

A packed block restarts its position ids at each document. transformers turns that into a dense
[B, 1, S, S] block-diagonal mask for SDPA, which computes every score of the block and masks most of
them. The two document-aware kernels compute only what each document needs:

- flex: transformers' own FlexAttention path; its mask interface builds one BlockMask per forward
  from the packed position ids (create_block_mask, compiled once per shape), and every layer reuses it.
  GPUs only: FlexAttention has no backward on CPU.
- varlen: documents as variable-length sequences, no mask tensor. On CUDA transformers' flash-attention
  path (cumulative sequence lengths from the position ids); elsewhere `document_attention` below, causal
  SDPA per document, registered through transformers' attention interface as "meshlm_varlen".
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask, sdpa_mask

from meshlm import compat
from meshlm.errors import MeshlmError
from meshlm.models import families

CHOICES = ("auto", "sdpa", "flex", "varlen")
DOCUMENTS = "meshlm_varlen"


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
    sequences of L and given to causal SDPA as they lie: no gather, no padding, no mask. Rows that are one
    document each (the common case of short blocks) are one run, one call. The outputs are concatenated in token
    order: one copy forward (as SDPA's own output transpose), one per input backward (the split's).
    """

    def __init__(self, position_ids: torch.Tensor):
        runs: list[list[int]] = []
        for row in document_lengths(position_ids):
            for length in row:
                if runs and runs[-1][1] == length:
                    runs[-1][0] += 1
                else:
                    runs.append([1, length])
        self.runs = [(n, length) for n, length in runs]

    def run(self, query, key, value, dropout: float, scaling) -> torch.Tensor:
        """[B, H, S, D] each -> [B, S, H, D], causal attention within each document."""
        b, h, s, d = query.shape
        sizes = [n * length for n, length in self.runs]
        pieces = [t.transpose(1, 2).reshape(b * s, h, d).split(sizes) for t in (query, key, value)]
        outs = []
        for (n, length), q, k, v in zip(self.runs, *pieces):
            q, k, v = (t.view(n, length, h, d).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True)
            outs.append(o.transpose(1, 2).reshape(n * length, h, d))
        return torch.cat(outs).view(b, s, h, d)


class _Plans:
    """The plan of the micro-batch being run: made once, every layer's call reuses it."""

    def __init__(self):
        self.position_ids, self.plan = None, None

    def of(self, position_ids: torch.Tensor, batch: int) -> Plan:
        if position_ids is not self.position_ids:  # the same tensor reaches every layer of one forward
            self.position_ids, self.plan = position_ids, Plan(position_ids.expand(batch, -1))
        return self.plan


_plans = _Plans()


def document_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal SDPA within each packed document ([B, H, S, D] in, [B, S, H, D] out as transformers' kernels).

    A padding mask (generate), a cache (decoding) or fake tensors (meshlm plan --simulate: shapes without the
    positions' values) go to transformers' SDPA path.
    """
    position_ids = kwargs.get("position_ids")
    documents = position_ids is not None and not isinstance(position_ids, compat.FakeTensor)
    if attention_mask is not None or not documents or query.shape[2] != key.shape[2] or query.shape[2] == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return _plans.of(position_ids, query.shape[0]).run(query, key, value, dropout, scaling), None


def _document_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed training blocks (the kernel reads the position ids); generate's padding mask as SDPA's."""
    if attention_mask is not None and not bool(attention_mask.all()):
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    return flash_attention_mask(*args, attention_mask=None, **kwargs)


AttentionInterface.register(DOCUMENTS, document_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DOCUMENTS, _document_mask)


def _sliding(config) -> bool:
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _plain(config) -> str:
    """Why a per-document causal SDPA would not compute this family's attention exactly ("" if it does)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "soft-capped scores"
    if _sliding(config):
        return "a sliding window"
    return "attention sinks" if getattr(config, "sinks", False) else ""


CPU_DOCUMENTS_FROM = 512  # sequence length from which documents one by one beat the dense mask on CPU
# (benchmarks/attention.py, BENCHMARKS.md 16: 1.04x causal at 512, 1.13x at 1024; at 128 the extra SDPA calls cost more)


def implementation(choice: str, config, cuda: bool, seq_length: int) -> str:
    """transformers' attn_implementation for --attention `choice` (MeshlmError if it cannot run here)."""
    family = getattr(config, "model_type", "this model")
    base = families.attention(config)  # sdpa, or eager where the family has none
    cls = families.model_class(config)
    has_flex = cls is None or getattr(cls, "_supports_flex_attn", False)
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    exact = base == "sdpa" and not _plain(config)
    if choice == "auto":
        if cuda:  # flex joins auto's choices once make gpu-check has measured it (no GPU was lent to issue 23)
            return "flash_attention_2" if flash and exact else base
        return DOCUMENTS if exact and seq_length >= CPU_DOCUMENTS_FROM else base
    if choice == "sdpa":
        return base
    if choice == "flex":
        if not cuda:
            raise MeshlmError("--attention flex: FlexAttention has no backward on CPU; use --attention varlen or sdpa")
        if not has_flex:
            raise MeshlmError(f"--attention flex: {family} has no FlexAttention path; use --attention sdpa")
        return "flex_attention"
    if not exact:
        why = _plain(config) or "no SDPA path"
        raise MeshlmError(f"--attention varlen: {family}'s attention has {why}; use --attention flex or sdpa")
    if cuda and not flash:
        raise MeshlmError("--attention varlen on CUDA needs the flash-attn package; install it or use --attention flex")
    return "flash_attention_2" if cuda else DOCUMENTS
