"""A built model's parts, found on the model itself with no registry entry: the decoder, the LM head, whether the
head is tied to the token embedding, the blocks, a mixture of experts' router class, the name a weight has in the
plain model, and transformers' class for a config."""

from __future__ import annotations

import re

from torch import nn


def decoder(model: nn.Module) -> nn.Module:
    """The causal LM's base model (transformers' `base_model_prefix` attribute; Llama 4's text model names the
    prefix of its multimodal model, language_model, and holds its decoder as `model`)."""
    found = getattr(model, model.base_model_prefix, None)
    return found if found is not None else model.model


def base_name(name: str) -> str:
    """The name a LoRA-wrapped base weight has in the model without adapters (peft keeps it under
    `<path>.base_layer`, once per adapted weight of a module: `experts.base_layer.base_layer.gate_up_proj`): what
    seeds its initial value and what --pretrained safetensors call it, so a LoRA run's base is the plain model's,
    as export and generate rebuild it (models/source.py)."""
    return re.sub(r"(\.base_layer)+\.", ".", name)


def head_name(model: nn.Module) -> str | None:
    """The attribute of the causal LM that holds the LM head (lm_head, embed_out, ...)."""
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_children() if m is head), None) if head is not None else None


def tied(model: nn.Module) -> bool:
    """True when the LM head shares its weight with the token embedding (transformers' `_tied_weights_keys`): the
    one answer every layout and checkpoint writer reads. Checked by identity, so ask before a layout replaces the
    weights; a module without an embedding or head (a pipeline stage's part) is untied."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and embed is not None and getattr(head, "weight", None) is embed.weight


def _block_class_names(model: nn.Module) -> set[str]:
    # transformers names the class that must never be split across devices: that is the block.
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def _unwrapped(m: nn.Module) -> nn.Module:
    """The block inside an activation-checkpoint wrapper (or the module itself)."""
    return getattr(m, "_checkpoint_wrapped_module", m)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList holding the model's blocks (possibly already wrapped): the FSDP, recomputation and
    compile units; works on pipeline stages too. Found by the class names in `_no_split_modules`; models
    without them fall back to the longest ModuleList, the block stack in every decoder-only model we know."""
    names = _block_class_names(model)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    for blocks in lists:
        if names and all(type(_unwrapped(b)).__name__ in names for b in blocks):
            return blocks
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of transformer blocks")
    return max(lists, key=len)


def supports_attention_interface(config) -> bool:
    """Whether the family's attention calls transformers' attention interface (`_supports_attention_backend`):
    then an attention function registered there (context parallel's) replaces the kernel."""
    cls = model_class(config)
    return cls is not None and getattr(cls, "_supports_attention_backend", False)


def model_class(config):
    """transformers' causal-LM class of this config (None for a remote-code model)."""
    from meshlm.compat_transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


def attention(config) -> str:
    """The attention implementation meshlm builds with: sdpa, or eager where the family has none (Gemma 2: SDPA
    has no soft-capping of the scores, though transformers 5.17-5.20 mark Gemma 2 as supporting SDPA)."""
    cls = model_class(config)
    no_sdpa = cls is not None and not getattr(cls, "_supports_sdpa", True)
    return "eager" if no_sdpa or getattr(config, "attn_logit_softcapping", None) is not None else "sdpa"


def router_recorder(model: nn.Module):
    """transformers' record of a mixture of experts' router logits (its target_class, the output's index), or None."""
    return (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")


def router_class(model: nn.Module) -> type | None:
    """The module class whose output transformers records as `router_logits` (None for a dense model)."""
    return getattr(router_recorder(model), "target_class", None)
