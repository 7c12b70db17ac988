"""Where the pieces of a transformers decoder live, per model family.

Tensor parallel, pipeline parallel and layer split all need the same map:
which modules embed tokens, which ModuleList holds the blocks, the final norm,
the rotary embedding, and inside a block the attention, MLP and norm modules.
transformers names them differently per family (GPT-2: transformer.h.N.attn,
Llama: model.layers.N.self_attn); this table is the one place that knows.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshlm.errors import MeshlmError


@dataclass(frozen=True)
class Parts:
    base: str  # attribute of the causal LM holding the decoder (its base_model_prefix)
    embed: tuple[str, ...]  # token (and absolute position) embeddings, on the first stage
    layers: str  # the ModuleList of blocks
    norm: str  # final norm, on the last stage
    rotary: str | None  # rotary embedding: every stage needs it (it holds no weights)
    block_norms: tuple[str, ...]  # norms inside a block (sequence-parallel regions)
    attn: str  # attention module inside a block
    mlp: str  # MLP module inside a block
    attn_kwarg: str | None  # the name the block passes hidden states to attention with (None: positional)


LLAMA = Parts(
    "model",
    ("embed_tokens",),
    "layers",
    "norm",
    "rotary_emb",
    ("input_layernorm", "post_attention_layernorm"),
    "self_attn",
    "mlp",
    "hidden_states",
)
GPT2 = Parts("transformer", ("wte", "wpe", "drop"), "h", "ln_f", None, ("ln_1", "ln_2"), "attn", "mlp", None)

# Families whose decoder layer has Llama's signature (rotary position embeddings passed in by the model).
FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gpt2": GPT2}


def family(config, what: str) -> Parts:
    """The parts map of a model config's family, or a one-line error naming the families `what` supports."""
    kind = config.model_type
    if kind not in FAMILIES:
        raise MeshlmError(f"{what} does not support model family {kind!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[kind]


def parts_of(model: nn.Module, what: str) -> Parts:
    return family(model.config, what)


def decoder(model: nn.Module, p: Parts) -> nn.Module:
    return getattr(model, p.base)


def tied(model: nn.Module) -> bool:
    """True when the LM head shares its weight with the token embedding (GPT-2)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight
