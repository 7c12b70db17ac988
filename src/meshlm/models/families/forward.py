"""What a decoder's own forward does around its parts. A pipeline stage runs the parts itself (models/stages.py),
so it repeats what transformers' forward adds: masks per layer type, rotary or its stand-in, embedding and logits
scaling."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from meshlm.errors import MeshlmError
from meshlm.models.families.parts import decoder


def layer_type(config, layer: int) -> str:
    """Layer `layer`'s attention type: the config's layer_types (Gemma 2/3, Qwen 2, SmolLM 3), else sliding
    everywhere when the config sets a window (Mistral, Phi-3, StarCoder 2), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def cache_argument(block: nn.Module) -> str:
    """The name a block takes its KV cache under: past_key_values, cache (transformers 5.24 on) or layer_past
    (GPT-NeoX, GPT-J, Falcon...)."""
    return cache_keyword(block.forward)


def cache_keyword(fn) -> str:
    """The keyword `fn` (a block's forward, a mask function) takes the KV cache under: the old name is only a
    deprecated alias where a release renamed it, and passing it warns on every call."""
    params = inspect.signature(fn).parameters
    return next((name for name in ("past_key_values", "cache", "layer_past") if name in params), "past_key_values")


def cache_index(block: nn.Module, index: int) -> int:
    """The KV cache entry of a block's first attention: its `index` in the layer list, or where a block holds
    several attentions (LongCat-Flash: two, entries 2i and 2i+1) the lowest `layer_idx` inside it. A stage reads
    its past length and sizes its masks there: on a later pipeline stage the entry of block `index` may be
    another block's, empty in this stage's own cache."""
    ids = [m.layer_idx for m in block.modules() if m is not block and isinstance(getattr(m, "layer_idx", None), int)]
    return min(ids, default=index)


def masks_see_positions(model: nn.Module) -> bool:
    """Whether the decoder's own forward gives position_ids to its causal-mask functions, read from its source.
    Most do, so packed sequences (positions restarting at each document) attend within their own document;
    GPT-OSS, AFMoE and GraniteMoeHybrid do not, and attend across documents. A pipeline stage makes its masks
    as the model's forward does."""
    from meshlm import compat_transformers

    return compat_transformers.masks_see_positions(type(decoder(model)))


def mask_function(model: nn.Module, kind: str):
    """The mask function the decoder's own forward uses for layers of attention type `kind`: linear-attention
    layers (MiniMax, Qwen3-Next) get their padding-only mask, sliding-window layers the window's, indexed-attention
    layers (DeepSeek-V3.2) a mask that is always made; a forward that picks its one mask by whether the config
    sets a window (Mistral, MiniMax) slides every softmax-attention layer when it does."""
    from meshlm import compat_transformers
    from meshlm.compat_transformers import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_recurrent_attention_mask,
        create_sliding_window_causal_mask,
    )

    if kind == "linear_attention":
        return create_recurrent_attention_mask
    if kind == "chunked_attention":  # Llama 4: attention within chunks of config.attention_chunk_size tokens
        return create_chunked_causal_mask
    if kind in compat_transformers.INDEXED_ATTENTION:  # a sparse-attention indexer (DeepSeek-V3.2) reads the mask
        return functools.partial(create_causal_mask, allow_is_causal_skip=False)
    window_by_config = compat_transformers.window_by_config(type(decoder(model)))
    # "sliding" in the name: Inkling's layer types are hybrid (full) and hybrid_sliding
    sliding = "sliding" in kind or (window_by_config and getattr(model.config, "sliding_window", None))
    return create_sliding_window_causal_mask if sliding else create_causal_mask


def attention_scaling(config, rotary: nn.Module, kind: str, position_ids: torch.Tensor) -> torch.Tensor | None:
    """The query scaling a layer without rotary embedding takes where its decoder's forward computes one (Beam:
    a layer type whose rope_parameters entry is None runs without rotary, its queries scaled by position with
    its modeling module's compute_attention_scaling); None for a rotary layer type or another family."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or kind not in params or params[kind] is not None:
        return None
    scaling = getattr(inspect.getmodule(type(rotary)), "compute_attention_scaling", None)
    if scaling is None:
        raise MeshlmError(
            f"{config.model_type}: its {kind} layers have no rotary embedding and meshlm does not know what its "
            f"forward gives them instead; use a layout without pipeline stages"
        )
    return scaling(position_ids)


def scaled_embeddings(config, h: torch.Tensor) -> torch.Tensor:
    """The decoder multiplies the token embeddings by config.embedding_multiplier (Granite). Gemma's scale
    lives in its embedding module and needs nothing here. Inkling's config answers to the name as an alias of
    its logits_mup_width_multiplier, which divides the final hidden states instead (final_logits)."""
    if "embedding_multiplier" in getattr(type(config), "attribute_map", {}):
        return h
    m = getattr(config, "embedding_multiplier", None)
    return h * m if m is not None else h


def changes_logits(config) -> bool:
    """Whether final_logits changes the head's output (a loss computed inside the head would then be wrong)."""
    keys = ("logits_scaling", "logit_scale", "logits_mup_width_multiplier")
    scaled = any(getattr(config, k, None) not in (None, 1, 1.0) for k in keys)
    return scaled or bool(getattr(config, "final_logit_softcapping", None))


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What the causal LM's forward does to the head's output: divide by config.logits_scaling (Granite) or
    config.logits_mup_width_multiplier (Inkling: it divides the head's input, the same for a head without bias),
    or multiply by config.logit_scale (Cohere), then soft-cap with config.final_logit_softcapping (Gemma 2/3), in
    transformers' order of operations. All are elementwise, so they apply as well to logits sharded over the
    vocabulary."""
    for key in ("logits_scaling", "logits_mup_width_multiplier"):
        if getattr(config, key, None) is not None:
            logits = logits / getattr(config, key)
    multiplier = getattr(config, "logit_scale", None)
    if multiplier is not None:
        logits = logits * multiplier
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    return logits
