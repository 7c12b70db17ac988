"""Every private or recently added transformers name meshlm uses, looked up here once and nowhere else.

transformers' submodules (masking_utils, core_model_loading, conversion_mapping, integrations) change between
minor releases without notice: a name appears in one release and leaves in another. Each name below says what
meshlm does on a release that lacks it: meshlm's own small equivalent where one is short, otherwise a one-line
`meshlm: error:` naming the feature and the releases that have it, raised when that feature is used (never at
import, so everything else still runs). Other modules import only transformers' top-level names;
tests/unit/test_compat_transformers.py checks every name here against the installed release and that no other
module reaches into a transformers submodule. The releases meshlm is tested with are in versions.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re

from meshlm.compat import Absent, lookup
from meshlm.errors import MeshlmError


def missing(what: str, feature: str) -> MeshlmError:
    from meshlm import versions  # the tested range, for the error only

    return MeshlmError(
        f"{feature} needs transformers' {what}, which transformers {versions.installed('transformers')} does not "
        f"have; install a release from {versions.tested('transformers')}"
    )


def _packed_sequence_compatibility(mask_function, position_ids, packed_sequence_mask):
    """Each document of a packed row attends only within itself, at its own positions: what transformers 5.23's
    packed_sequence_compatibility_function does (5.17-5.22 and 5.24 build it inside create_causal_mask only)."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        same = packed_sequence_mask[batch_idx, q_idx] == packed_sequence_mask[batch_idx, kv_idx]
        positions = position_ids[batch_idx, q_idx], position_ids[batch_idx, kv_idx]
        return same & mask_function(batch_idx, head_idx, *positions)

    return inner


def _apply_converters(source_key: str, converters: list) -> tuple[str, str | None]:
    """`source_key` renamed by the first converter that matches it, and that converter's pattern (None: none did),
    as transformers 5.23's apply_converters."""
    for converter in converters:
        renamed, pattern = converter.rename_source_key(source_key)
        if pattern is not None:
            return renamed, pattern
    return source_key, None


ATTENTION = "meshlm's attention kernels"
MASKS = "packed-sequence masks"
LOADING = "reading a checkpoint's tensors (transformers' conversion mapping)"
EXPORT = "meshlm export"
SIMULATE = "meshlm plan --simulate"

_MASKING = "transformers.masking_utils"
_LOADING = "transformers.core_model_loading"

# Each name meshlm imports from here -> (transformers' module, its name there, what needs it or the fallback).
# Resolved on first use, not when this module loads: a module that imports a name inside a function keeps the
# import of transformers' submodule off every other command.
NAMES = {
    "ALL_MASK_ATTENTION_FUNCTIONS": (_MASKING, "ALL_MASK_ATTENTION_FUNCTIONS", ATTENTION),
    "causal_mask_function": (_MASKING, "causal_mask_function", MASKS),
    "sliding_window_causal_mask_function": (_MASKING, "sliding_window_causal_mask_function", MASKS),
    "find_packed_sequence_indices": (_MASKING, "find_packed_sequence_indices", MASKS),
    # in 5.23 only; the same rule in a few lines
    "packed_sequence_compatibility_function": (
        _MASKING,
        "packed_sequence_compatibility_function",
        _packed_sequence_compatibility,
    ),
    "sdpa_mask": (_MASKING, "sdpa_mask", ATTENTION),
    "flash_attention_mask": (_MASKING, "flash_attention_mask", ATTENTION),
    "create_causal_mask": (_MASKING, "create_causal_mask", MASKS),
    "create_chunked_causal_mask": (_MASKING, "create_chunked_causal_mask", MASKS),
    "create_recurrent_attention_mask": (_MASKING, "create_recurrent_attention_mask", MASKS),
    "create_sliding_window_causal_mask": (_MASKING, "create_sliding_window_causal_mask", MASKS),
    "ALL_ATTENTION_FUNCTIONS": ("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", ATTENTION),
    "sdpa_attention_forward": ("transformers.integrations.sdpa_attention", "sdpa_attention_forward", ATTENTION),
    "get_model_conversion_mapping": ("transformers.conversion_mapping", "get_model_conversion_mapping", LOADING),
    "WeightConverter": (_LOADING, "WeightConverter", LOADING),
    "WeightRenaming": (_LOADING, "WeightRenaming", LOADING),
    "PrefixChange": (_LOADING, "PrefixChange", LOADING),
    "Chunk": (_LOADING, "Chunk", LOADING),
    "Concatenate": (_LOADING, "Concatenate", LOADING),
    "MergeModulelist": (_LOADING, "MergeModulelist", LOADING),
    "Transpose": (_LOADING, "Transpose", LOADING),
    "dot_natural_key": (_LOADING, "dot_natural_key", LOADING),
    "rename_source_key": (_LOADING, "rename_source_key", LOADING),
    "revert_weight_conversion": (_LOADING, "revert_weight_conversion", EXPORT),
    # in 5.23 and later; the same loop over the converters
    "apply_converters": (_LOADING, "apply_converters", _apply_converters),
    "Conv1D": ("transformers.pytorch_utils", "Conv1D", "--lora.r on a model with Conv1D projections (GPT-2)"),
    "MODEL_FOR_CAUSAL_LM_MAPPING": (
        "transformers.models.auto.modeling_auto",
        "MODEL_FOR_CAUSAL_LM_MAPPING",
        "finding a config's causal-LM class",
    ),
}


# The style base_model_ep_plan gives the module tokens are dispatched to: "ep_dispatch_experts", which older
# releases (5.17) call "moe_tp_experts" (in an ep plan only that module has either).
EP_DISPATCH_STYLES = ("ep_dispatch_experts", "moe_tp_experts")


# The layer type of attention whose sparse indexer reads the causal mask: "indexed_attention", which older releases
# (5.17-5.22) call "deepseek_sparse_attention".
INDEXED_ATTENTION = ("indexed_attention", "deepseek_sparse_attention")


def embedding_norms(model_type: str) -> tuple[str, ...]:
    """The decoder's modules after its token embedding that its pp plan leaves out: Inkling norms its embeddings
    inside the embedding module from 5.23 (InklingNormedEmbedding), in an embed_norm module of its own before."""
    if model_type != "inkling_text":
        return ()
    return () if lookup("transformers.models.inkling.modeling_inkling", "InklingNormedEmbedding") else ("embed_norm",)


def transformers_name(name: str):
    """The transformers object NAMES names, its fallback, or what raises the one line when used."""
    module, attr, needed = NAMES[name]
    found = lookup(module, attr)
    if found is not None or not isinstance(needed, str):
        return needed if found is None else found
    return Absent(f"{module}.{attr}", needed, missing)


def __getattr__(name: str):
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value = transformers_name(name)
    return value


@contextlib.contextmanager
def grouped_mm_replaced(fn):
    """transformers' grouped experts run their matmuls through `fn` while active (integrations.moe's private
    _grouped_mm, the one function every grouped-experts forward calls)."""
    moe = lookup("transformers.integrations", "moe")
    if moe is None or not hasattr(moe, "_grouped_mm"):
        raise missing("integrations.moe._grouped_mm", SIMULATE)
    real = moe._grouped_mm
    moe._grouped_mm = fn
    try:
        yield
    finally:
        moe._grouped_mm = real


# ------------------------------------------ facts read from a decoder's forward source (no config field has them)


@functools.cache
def _forward_source(forward) -> str:
    try:
        return inspect.getsource(forward)
    except (OSError, TypeError):  # no source (a compiled or dynamically made class)
        return ""


_MASK_ARGUMENTS = re.compile(r"mask_kwargs = \{[^}]*\}|create_\w*causal_mask\([^)]*\)")
_WINDOW_BY_CONFIG = "create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask"


def masks_see_positions(decoder_class: type) -> bool:
    """Whether the decoder's forward gives position_ids to its causal-mask functions (then packed documents attend
    within themselves). Read from its source: no config field or attribute says it."""
    found = _MASK_ARGUMENTS.findall(_forward_source(decoder_class.forward))
    return not found or any("position_ids" in f for f in found)  # no source: the common case


def window_by_config(decoder_class: type) -> bool:
    """Whether the decoder's forward picks its one mask by whether the config sets a sliding window (Mistral,
    MiniMax), whatever the layer types say. Read from its source, as masks_see_positions."""
    return _WINDOW_BY_CONFIG in _forward_source(decoder_class.forward)
