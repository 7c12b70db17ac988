"""meshlm's own entry for each family whose transformers metadata is missing something or that meshlm splits better:
every fact about one family lives in its entry here, next to its TP plan, and nowhere else (parallel/ applies the
styles an entry names without knowing which family names them).

An entry names only the fields it changes (fields of `registry.Family`), over what transformers' metadata gives:

- `tp_plan`: the whole TP plan, in meshlm's style names, in place of transformers' `base_model_tp_plan`;
- `plan_entries`: entries put over transformers' own plan (before its style names are translated and its experts
  left to parallel/expert.py), keeping its other entries;
- any other field of `Family` (`embed`, `layers`, `norm`, `fused`, `unsplittable`, ...) in place of the default.

A user's own family takes the same fields through `register()`.
"""

from __future__ import annotations

_QKV = ("q_proj", "k_proj", "v_proj")
_GATED_MLP = (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))


def _attention(norm: str | None = None) -> dict[str, str]:
    """Attention split by heads: q/k/v by columns, o_proj by rows; its q/k norms in style `norm` when given."""
    norms = {f"layers.*.self_attn.{n}": norm for n in ("q_norm", "k_norm")} if norm else {}
    return {**{f"layers.*.self_attn.{p}": "colwise" for p in _QKV}, **norms, "layers.*.self_attn.o_proj": "rowwise"}


def _mlp(at: str = "layers.*.mlp.") -> dict[str, str]:
    """A gated MLP at `at`: gate and up by columns, down by rows."""
    return {f"{at}{p}": s for p, s in _GATED_MLP}


# OLMo 2 normalises q and k over the full projection width. transformers' plan gathers the projections
# (colwise_gather_output) and splits them again; meshlm keeps them split by heads and all-reduces the norm's
# per-token sum of squares instead (sharded_norm).
_FULL_WIDTH_QK_NORMS = _attention("sharded_norm")
# Phi-3 (and Phi-4), GLM and GLM-4 fuse [gate | up] (Phi-3 also [q | k | v]). transformers' plan gathers each fused
# output; meshlm holds the parts as separate projections (models/fused.py), each split by its own heads or columns.
_FUSED_GATE_UP = {"mlp.gate_up_proj": {"gate_proj": "mlp", "up_proj": "mlp"}}
_FUSED_MLP_PLAN = {
    "layers.*.mlp.gate_up_proj.gate_proj": "colwise",
    "layers.*.mlp.gate_up_proj.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# Attention sinks split with the heads: their attention takes local_params, which plans before 5.23 leave out.
_SINKS = {"plan_entries": {"layers.*.self_attn": "local_params"}}

ENTRIES: dict[str, dict] = {
    "gpt2": {
        "embed": ("wte", "wpe", "drop"),
        "layers": "h",
        "norm": "ln_f",
        "rotary": None,
        "positions": "wpe",
        "conv1d": True,
        "planner_kind": "gpt2",
        # Conv1D projections; c_attn is [q | k | v] fused: each rank keeps its own heads of each.
        "tp_plan": {
            "h.*.attn.c_attn": "fused_qkv",
            "h.*.attn.c_proj": "conv1d_rowwise",
            "h.*.mlp.c_fc": "conv1d_colwise",
            "h.*.mlp.c_proj": "conv1d_rowwise",
        },
        "lora_targets": ("c_attn", "c_proj", "c_fc"),
    },
    "olmo2": {"tp_plan": {**_FULL_WIDTH_QK_NORMS, **_mlp()}},
    # OLMo 3 is OLMo 2 with sliding-window layers: the same full-width q/k norms.
    "olmo3": {"tp_plan": {**_FULL_WIDTH_QK_NORMS, **_mlp()}},
    # OLMoE normalises q and k over the full width as OLMo 2 does; its experts are split by parallel/expert.py.
    # transformers ships no pp plan for it: its decoder has Llama's parts.
    "olmoe": {"embed": ("embed_tokens",), "layers": "layers", "norm": "norm", "tp_plan": dict(_FULL_WIDTH_QK_NORMS)},
    "phi3": {
        "fused": {
            "self_attn.qkv_proj": {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads"},
            **_FUSED_GATE_UP,
        },
        "tp_plan": {
            **{f"layers.*.self_attn.qkv_proj.{p}": "colwise" for p in _QKV},
            "layers.*.self_attn.o_proj": "rowwise",
            **_FUSED_MLP_PLAN,
        },
    },
    # GLM and GLM-4: transformers' plan gathers [gate | up] (colwise_gather_output) and splits the down projection's
    # input again (rowwise_split_input). meshlm holds the parts.
    "glm": {"fused": _FUSED_GATE_UP, "tp_plan": {**_attention(), **_FUSED_MLP_PLAN}},
    "glm4": {"fused": _FUSED_GATE_UP, "tp_plan": {**_attention(), **_FUSED_MLP_PLAN}},
    # DeepSeek-V3's attention is DeepSeek-V2's multi-head latent attention, but transformers' plan for it splits only
    # the MLPs: meshlm splits its heads as DeepSeek-V2's plan does.
    "deepseek_v3": {
        "plan_entries": {
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.q_b_proj": "colwise",
            "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
            "layers.*.self_attn.kv_b_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise",
        }
    },
    # Where transformers' plan gathers q, k and v (colwise_gather_output) for q/k norms, meshlm keeps them split by
    # heads: a full-width norm as OLMo 2's (sharded_norm), a per-head one replicated (head_norm).
    "minimax_m2": {"plan_entries": _attention("sharded_norm")},
    "olmo_hybrid": {"plan_entries": _attention("sharded_norm")},
    "flex_olmo": {"plan_entries": _attention("sharded_norm")},
    "minimax_m3_vl_text": {"plan_entries": _attention("head_norm")},
    # Doge's attention makes each key/value head's dynamic mask from all heads' values (dt_proj) and its own entry of
    # A: transformers' plan all-reduces dt_proj's output for every head, so its own tp fails where the mask meets this
    # rank's heads. meshlm reduce-scatters it by head (scattered_rowwise) and splits A with the heads (local_params);
    # its per-head q/k norms are replicated with their gradients all-reduced (head_norm). Its MoE MLP multiplies
    # expert embeddings with its input: split by rows, as 5.23's plan says (5.17-5.22 name the style
    # rowwise_split_input), the MLP then takes its input whole (parallel/tensor.py's whole submodules). Its blocks
    # hold residual scales of their own, which sequence parallel keeps replicated with a summed gradient.
    "doge": {
        "plan_entries": {
            "layers.*.self_attn": "local_params",
            "layers.*.self_attn.A": "colwise",
            "layers.*.self_attn.dt_proj": "scattered_rowwise",
            **{f"layers.*.self_attn.{n}": "head_norm" for n in ("q_norm", "k_norm")},
            **{f"layers.*.mlp.{e}": "embedding_rowwise" for e in ("down_embed", "up_embed")},
        }
    },
    "granite_swa": _SINKS,
    "granitemoe_swa": _SINKS,
    "hy_v4": {
        **_SINKS,
        "unsplittable": "its blocks pass hyper-connection streams and the indexer's top-k choices to the next block",
    },
    "mimo_v2_flash": _SINKS,  # sinks in its sliding-window layers only: found on the blocks
    # GPT-OSS: transformers ships no base_model_tp_plan (its own tp_plan="auto" splits only the LM head, from the
    # causal LM's _tp_plan). meshlm splits the attention by heads (q/k/v and o_proj with their biases), each head's
    # attention sink with it (local_params), and the experts whole (its base_model_ep_plan: parallel/expert.py).
    "gpt_oss": {
        "plan_entries": {**_attention(), "layers.*.self_attn": "local_params", "layers.*.self_attn.sinks": "colwise"}
    },
    # Decoders whose forward carries more than the hidden states from block to block.
    "glm_moe_dsa": {"unsplittable": "its blocks pass the indexer's top-k choices on to the next block"},
    "deepseek_v4": {
        "unsplittable": "its blocks take the token ids and compressed-attention caches that its own forward makes"
    },
    "hrm_text": {
        "unsplittable": "it runs its two recurrent stacks (H_module, L_module) over each other in cycles, and its "
        "base_model_pp_plan names a layer list it does not have"
    },
    # Inkling 2 passes a second per-token stream (the block states its attention residuals read) from block to block,
    # built in the decoder's own loop from each block's input: sequence shards would have to start at the embedding.
    "inkling2_text": {
        "no_sequence_parallel": "its decoder carries a second per-token stream (block_states) between its blocks, "
        "outside them"
    },
    # Llama 4 (text): transformers ships no pp plan, and its TP plan splits every expert's width (packed_rowwise,
    # moe_tp_experts: torch's private _StridedShard). meshlm gives each rank whole experts (whole_experts), whose
    # block returns its rows flat; the rest of transformers' plan is kept: attention by heads, the shared expert and
    # the dense MLPs by columns.
    "llama4_text": {
        "embed": ("embed_tokens",),
        "layers": "layers",
        "norm": "norm",
        "tp_plan": {
            **_attention(),
            "layers.*.feed_forward.experts": "whole_experts",
            **_mlp("layers.*.feed_forward.shared_expert."),
            **_mlp("layers.*.feed_forward."),
        },
    },
    # LongCat-Flash: two MLA attentions and two dense MLPs per block (ModuleLists), split as transformers' plan says;
    # its mixture of experts stays whole on every tp rank. Its gate_up_proj holds rows for the identity (zero)
    # experts that down_proj does not ([routed + zero] against [routed]), so no even split of the expert dimension
    # gives a rank the same experts in both, and splitting each expert's width (transformers' packed_colwise) needs
    # torch's private _StridedShard.
    "longcat_flash": {
        "tp_plan": {
            "layers.*.self_attn.*.q_a_proj": "replicated",
            "layers.*.self_attn.*.q_b_proj": "colwise",
            "layers.*.self_attn.*.kv_a_proj_with_mqa": "mla_kv_a_proj",
            "layers.*.self_attn.*.kv_b_proj": "colwise",
            "layers.*.self_attn.*.o_proj": "rowwise",
            **_mlp("layers.*.mlps.*."),
        }
    },
}
