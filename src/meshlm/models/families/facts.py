"""A config's dimensions as the planner and the layout checks read them: each family's own names for them
(num_local_experts, n_routed_experts, ...) are read here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import MeshlmError


@dataclass(frozen=True)
class Facts:
    """A config's dimensions as the planner and the layout checks read them."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # MLP width (a dense block's)
    layers: int
    vocab: int
    max_positions: int
    tied: bool
    experts: int  # 0 for a dense model
    active_experts: int
    expert_mlp: int  # one expert's MLP width (0 for a dense model)
    moe_layers: int  # layers with experts (the others have a dense MLP)
    layer_types: tuple[str, ...]  # per layer: full_attention, sliding_attention, ...


def _first(config, *keys):
    return next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)


def facts(config) -> Facts:
    hidden, heads = _first(config, "hidden_size", "n_embd"), _first(config, "num_attention_heads", "n_head")
    layers = _first(config, "num_hidden_layers", "n_layer")
    if not (hidden and heads and layers):
        raise MeshlmError(
            f"its config ({config.model_type}) has no hidden size / heads / layers; "
            f"is it a decoder-only language model?"
        )
    types = getattr(config, "layer_types", None)
    experts = _first(config, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts") or 0
    return Facts(
        hidden=hidden,
        heads=heads,
        kv_heads=_first(config, "num_key_value_heads") or heads,
        head_dim=_first(config, "head_dim") or hidden // heads,
        mlp=_first(config, "intermediate_size", "n_inner") or 4 * hidden,
        layers=layers,
        vocab=_first(config, "vocab_size") or 0,
        max_positions=_first(config, "max_position_embeddings", "n_positions") or 0,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        experts=experts,
        active_experts=_first(config, "num_experts_per_tok", "moe_topk") or 0 if experts else 0,
        expert_mlp=_first(config, "moe_intermediate_size", "intermediate_size") or 0 if experts else 0,
        moe_layers=moe_layers(config, layers) if experts else 0,
        layer_types=tuple(types) if types else ("full_attention",) * layers,
    )


def moe_layers(config, layers: int) -> int:
    """Layers with experts: all, except Qwen-MoE's mlp_only_layers and every decoder_sparse_step-th, and
    DeepSeek's first_k_dense_replace dense layers."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    first_dense = getattr(config, "first_k_dense_replace", None) or 0
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense)


def router_experts(config) -> int:
    """The experts a router scores: the routed ones, then identity (zero) experts where the config has them
    (zero_expert_num), which take a token without computing anything."""
    return facts(config).experts + (getattr(config, "zero_expert_num", None) or 0)
