"""The model-family registry: everything meshlm knows about a transformers decoder family, in one place.

For a config's `model_type` it says where the token embedding, the blocks, the final norm and the rotary
embedding live (the pipeline cut points and the layer-split units), the tensor-parallel plan in meshlm's
DTensor styles (parallel/tensor.py turns the names into styles), the FSDP and recomputation units (the
blocks), which weights are tied, LoRA's default targets, and the facts the planner needs.

The default entry is read from transformers' own metadata: the config's `base_model_tp_plan` (module path ->
style) and `base_model_pp_plan` (embedding modules, the layer list and the final norm, in order); the
blocks are the model's `_no_split_modules`, the LM head is `get_output_embeddings()`, ties are found by
identity. `OVERRIDES` holds the few entries where that metadata is missing (GPT-2) or where meshlm does
better than transformers' style (see docs/families.md). Adding a family means nothing when transformers
ships both plans, else one entry here, or `register()` from the user's own code.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from meshlm.errors import MeshlmError

# transformers' TP style names -> meshlm's (parallel/tensor.py STYLES). Other names stay as they are, so an
# error can name the style meshlm lacks.
TRANSFORMERS_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "head_norm"}
LINEAR_STYLES = ("colwise", "rowwise")  # plain nn.Linear splits: LoRA shards its adapters alongside
DATA_PARALLEL = "single, ddp, zero1, zero2, zero3, fsdp, hsdp"  # layouts that need nothing from a family


@dataclass(frozen=True)
class Family:
    """One model family. Module paths are relative to the decoder (the causal LM's base model)."""

    model_type: str
    embed: tuple[str, ...] = ()  # modules before the blocks, in order; the first embeds the tokens
    layers: str | None = None  # the ModuleList of blocks (None: transformers ships no layer list)
    norm: str | None = None  # the final norm
    rotary: str | None = "rotary_emb"  # rotary embedding module: every stage needs it (it holds no weights)
    positions: str | None = None  # a learned absolute-position embedding added to the tokens' (GPT-2's wpe)
    tp_plan: dict[str, str] | None = None  # path pattern ("layers.*.self_attn.q_proj") -> meshlm TP style
    lora_targets: tuple[str, ...] = ()  # peft matches each against the end of a module path
    conv1d: bool = False  # projections are transformers' Conv1D, weight stored (in, out): peft's fan_in_fan_out
    planner_kind: str = "llama"  # which activation formulas plan/memory.py applies: llama (RMSNorm, gated MLP), gpt2
    # Fused projections held as parts (models/fused.py): block path -> {part: rows in units of heads, kv_heads, mlp}
    fused: dict[str, dict[str, str]] | None = None
    experts: str | None = None  # a mixture of experts' grouped experts module ("layers.*.mlp.experts"): ep plan
    # Why the decoder cannot be cut into stages although it has a layer list (its forward does more between
    # blocks than a stage repeats): pipeline parallel and layer split refuse with it. None: it can.
    unsplittable: str | None = None
    # Why its blocks cannot run on slices of the sequence under --parallel.sequence-parallel (None: they can).
    no_sequence_parallel: str | None = None
    source: str = "transformers"  # where the entry came from: transformers' metadata, an override, register()


# meshlm's own entries, applied over what transformers' metadata gives (or in its place where it gives none).
OVERRIDES: dict[str, dict] = {
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
}
# OLMo 2 normalises q and k over the full projection width. transformers' plan gathers the projections
# (colwise_gather_output) and splits them again; meshlm keeps them split by heads and all-reduces the norm's
# per-token sum of squares instead.
OVERRIDES["olmo2"] = {
    "tp_plan": {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "sharded_norm",
        "layers.*.self_attn.k_norm": "sharded_norm",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
}
# OLMoE normalises q and k over the full width as OLMo 2 does; its experts are split by parallel/expert.py.
# transformers ships no pp plan for it: its decoder has Llama's parts.
OVERRIDES["olmoe"] = {
    "embed": ("embed_tokens",),
    "layers": "layers",
    "norm": "norm",
    "tp_plan": {k: v for k, v in OVERRIDES["olmo2"]["tp_plan"].items() if ".mlp." not in k},
}
# Phi-3 (and Phi-4) fuse [q | k | v] and [gate | up]. transformers' plan gathers each fused output; meshlm
# holds the parts as separate projections (models/fused.py), each split by its own heads or columns.
OVERRIDES["phi3"] = {
    "fused": {
        "self_attn.qkv_proj": {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads"},
        "mlp.gate_up_proj": {"gate_proj": "mlp", "up_proj": "mlp"},
    },
    "tp_plan": {
        "layers.*.self_attn.qkv_proj.q_proj": "colwise",
        "layers.*.self_attn.qkv_proj.k_proj": "colwise",
        "layers.*.self_attn.qkv_proj.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_up_proj.gate_proj": "colwise",
        "layers.*.mlp.gate_up_proj.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
}
# OLMo 3 is OLMo 2 with sliding-window layers: the same full-width q/k norms.
OVERRIDES["olmo3"] = {"tp_plan": dict(OVERRIDES["olmo2"]["tp_plan"])}
# GLM and GLM-4 fuse [gate | up] as Phi-3 does; transformers' plan gathers it (colwise_gather_output) and
# splits the down projection's input again (rowwise_split_input). meshlm holds the parts.
for _glm in ("glm", "glm4"):
    OVERRIDES[_glm] = {
        "fused": {"mlp.gate_up_proj": {"gate_proj": "mlp", "up_proj": "mlp"}},
        "tp_plan": {
            **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_up_proj.gate_proj": "colwise",
            "layers.*.mlp.gate_up_proj.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
        },
    }
# Entries put over transformers' own TP plan (before the plan is translated and its experts left to
# parallel/expert.py), keeping its other entries. DeepSeek-V3's attention is DeepSeek-V2's multi-head latent
# attention, but transformers' plan for it splits only the MLPs: meshlm splits its heads as DeepSeek-V2's plan
# does. Where transformers' plan gathers q, k and v (colwise_gather_output) for q/k norms, meshlm keeps them split
# by heads: a full-width norm as OLMo 2's (sharded_norm), a per-head one replicated (head_norm).
PLAN_ENTRIES: dict[str, dict[str, str]] = {
    "deepseek_v3": {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    }
}
for _kind, _norm in (("minimax_m2", "sharded_norm"), ("olmo_hybrid", "sharded_norm"), ("flex_olmo", "sharded_norm"),
                     ("minimax_m3_vl_text", "head_norm")):  # fmt: skip
    PLAN_ENTRIES[_kind] = {
        **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        **{f"layers.*.self_attn.{n}": _norm for n in ("q_norm", "k_norm")},
        "layers.*.self_attn.o_proj": "rowwise",
    }
# Doge's attention makes each key/value head's dynamic mask from all heads' values (dt_proj) and its own entry of A:
# transformers' plan all-reduces dt_proj's output for every head, so its own tp fails where the mask meets this
# rank's heads. meshlm reduce-scatters it by head (scattered_rowwise) and splits A with the heads (local_params);
# its per-head q/k norms are replicated with their gradients all-reduced (head_norm).
PLAN_ENTRIES["doge"] = {
    "layers.*.self_attn": "local_params",
    "layers.*.self_attn.A": "colwise",
    "layers.*.self_attn.dt_proj": "scattered_rowwise",
    **{f"layers.*.self_attn.{n}": "head_norm" for n in ("q_norm", "k_norm")},
    # its expert embeddings split by rows, as 5.23's plan says (5.17-5.22 name the style rowwise_split_input)
    **{f"layers.*.mlp.{e}": "embedding_rowwise" for e in ("down_embed", "up_embed")},
}
# Attention sinks split with the heads: their attention takes local_params, which plans before 5.23 leave out.
for _kind in ("granite_swa", "granitemoe_swa", "hy_v4", "mimo_v2_flash"):
    PLAN_ENTRIES[_kind] = {"layers.*.self_attn": "local_params"}
# GPT-OSS: transformers ships no base_model_tp_plan (its own tp_plan="auto" splits only the LM head, from the causal
# LM's _tp_plan). meshlm splits the attention by heads (q/k/v and o_proj with their biases), each head's attention
# sink with it (local_params), and the experts whole (its base_model_ep_plan: parallel/expert.py).
PLAN_ENTRIES["gpt_oss"] = {
    **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn": "local_params",
    "layers.*.self_attn.sinks": "colwise",
}
# Decoders whose forward carries more than the hidden states from block to block.
OVERRIDES["glm_moe_dsa"] = {"unsplittable": "its blocks pass the indexer's top-k choices on to the next block"}
OVERRIDES["hy_v4"] = {
    "unsplittable": "its blocks pass hyper-connection streams and the indexer's top-k choices to the next block"
}
# Inkling 2 passes a second per-token stream (the block states its attention residuals read) from block to block,
# built in the decoder's own loop from each block's input: sequence shards would have to start at the embedding.
OVERRIDES["inkling2_text"] = {
    "no_sequence_parallel": "its decoder carries a second per-token stream (block_states) between its blocks, "
    "outside them"
}
OVERRIDES["hrm_text"] = {
    "unsplittable": "it runs its two recurrent stacks (H_module, L_module) over each other in cycles, and its "
    "base_model_pp_plan names a layer list it does not have"
}
_GATED_MLP = (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))
# Llama 4 (text): transformers ships no pp plan, and its TP plan splits every expert's width (packed_rowwise,
# moe_tp_experts: torch's private _StridedShard). meshlm gives each rank whole experts (whole_experts); the rest of
# transformers' plan is kept: attention by heads, the shared expert and the dense MLPs by columns.
OVERRIDES["llama4_text"] = {
    "embed": ("embed_tokens",),
    "layers": "layers",
    "norm": "norm",
    "tp_plan": {
        **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.feed_forward.experts": "whole_experts",
        **{f"layers.*.feed_forward.{m}{p}": s for m in ("shared_expert.", "") for p, s in _GATED_MLP},
    },
}
# LongCat-Flash: two MLA attentions and two dense MLPs per block (ModuleLists), split as transformers' plan says; its
# mixture of experts stays whole on every tp rank. Its gate_up_proj holds rows for the identity (zero) experts that
# down_proj does not ([routed + zero] against [routed]), so no even split of the expert dimension gives a rank the same
# experts in both, and splitting each expert's width (transformers' packed_colwise) needs torch's private _StridedShard.
OVERRIDES["longcat_flash"] = {
    "tp_plan": {
        "layers.*.self_attn.*.q_a_proj": "replicated",
        "layers.*.self_attn.*.q_b_proj": "colwise",
        "layers.*.self_attn.*.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.*.kv_b_proj": "colwise",
        "layers.*.self_attn.*.o_proj": "rowwise",
        **{f"layers.*.mlps.*.{p}": s for p, s in _GATED_MLP},
    }
}
OVERRIDES["deepseek_v4"] = {
    "unsplittable": "its blocks take the token ids and compressed-attention caches that its own forward makes"
}
_REGISTERED: dict[str, Family] = {}


def register(model_type: str, **entry) -> Family:
    """Add or replace a family from the user's own code (a model class registered with transformers' Auto
    classes): fields of `Family`, over what transformers' metadata of its config class gives."""
    from transformers import CONFIG_MAPPING

    unknown = set(entry) - {f.name for f in fields(Family)}
    if unknown:
        raise ValueError(f"register({model_type!r}): unknown fields {sorted(unknown)}")
    base = _from_metadata(CONFIG_MAPPING[model_type]) if model_type in CONFIG_MAPPING else Family(model_type)
    _REGISTERED[model_type] = _with(base, entry, "register()")
    return _REGISTERED[model_type]


def family(config) -> Family:
    """The registry's entry for a model config: registered, else transformers' metadata with meshlm's overrides."""
    kind = config.model_type
    if kind in _REGISTERED:
        return _REGISTERED[kind]
    fam = _from_metadata(config)
    return _with(fam, OVERRIDES[kind], "meshlm override") if kind in OVERRIDES else fam


def _with(fam: Family, entry: dict, source: str) -> Family:
    """`fam` with the fields `entry` names; LoRA's targets follow a new TP plan unless the entry names them."""
    targets = entry.get("lora_targets") or _linear_leaves(entry.get("tp_plan", fam.tp_plan))
    return replace(fam, **{**entry, "lora_targets": targets, "source": source})


def _from_metadata(config) -> Family:
    """What transformers' plans say (a config class or instance: the plans are class attributes)."""
    kind = config.model_type
    tp = {**(getattr(config, "base_model_tp_plan", None) or {}), **PLAN_ENTRIES.get(kind, {})} or None
    pp = getattr(config, "base_model_pp_plan", None) or {}
    layers = next((k for k, (inputs, _) in pp.items() if "attention_mask" in inputs), None)
    embed: tuple[str, ...] = ()
    norm = None
    if layers is not None:
        names = list(pp)
        embed, after = tuple(names[: names.index(layers)]), names[names.index(layers) + 1 :]
        norm = after[-1] if after else None
    if layers is None and tp:  # a TP plan alone (OLMoE, Nemotron-H) still names the layer list: "layers.*.mlp..."
        layers = next((k.split(".*.")[0] for k in tp if ".*." in k), None)
    experts = _experts_module(config)
    if embed:
        from meshlm.compat_transformers import embedding_norms

        embed = (*embed, *embedding_norms(kind))
    if tp and experts:  # meshlm splits a mixture of experts by whole experts (parallel/expert.py), not by width
        tp = {k: v for k, v in tp.items() if not k.startswith(experts)}
        if _all_sparse(config):  # no dense MLP in any block (Qwen3-MoE without mlp_only_layers): nothing to split
            block = experts.rsplit(".", 1)[0] + "."
            tp = {k: v for k, v in tp.items() if not k.startswith(block)}
    # A plan that split only the mixture of experts (Inkling) leaves an empty one: the experts split whole, the rest
    # of each block computed whole on every rank, as transformers' own plan keeps the attention.
    plan = _with_latents({k: TRANSFORMERS_STYLES.get(v, v) for k, v in tp.items()}) if tp is not None else None
    return Family(
        kind, embed=embed, layers=layers, norm=norm, tp_plan=plan, lora_targets=_linear_leaves(plan), experts=experts
    )


def _with_latents(plan: dict[str, str]) -> dict[str, str]:
    """Multi-head latent attention (DeepSeek-V2/V3 and kin): transformers' plan leaves the query's latent
    projection (q_a_proj) and a sparse-attention indexer's projections (DeepSeek-V3.2: it picks the tokens each
    query attends to, no gradient) out, plain modules in its TP. meshlm hands the attention a replicated
    DTensor, so the plan names them: computed whole on every rank."""
    whole = ("q_a_proj", "indexer.wq_b", "indexer.wk", "indexer.weights_proj")
    latents = [k for k, v in plan.items() if v == "mla_kv_a_proj"]
    return {**plan, **{k.replace("kv_a_proj_with_mqa", w): "replicated" for k in latents for w in whole}}


def _all_sparse(config) -> bool:
    """Every block of this config (an instance; a config class says nothing) is a mixture of experts."""
    layers = getattr(config, "num_hidden_layers", None)
    return isinstance(layers, int) and not isinstance(config, type) and _moe_layers(config, layers) == layers


def _experts_module(config) -> str | None:
    """The path pattern of a mixture of experts' grouped experts module: what transformers' base_model_ep_plan
    dispatches tokens to, None for a dense model or one meshlm cannot dispatch to."""
    from meshlm.compat_transformers import EP_DISPATCH_STYLES

    plan = getattr(config, "base_model_ep_plan", None) or {}
    return next((k for k, v in plan.items() if v in EP_DISPATCH_STYLES), None)


def _linear_leaves(plan: dict[str, str] | None) -> tuple[str, ...]:
    """LoRA's default targets: the projections a TP plan splits as plain Linear layers, in plan order."""
    leaves = [k.rsplit(".", 1)[-1] for k, v in (plan or {}).items() if v in LINEAR_STYLES]
    return tuple(dict.fromkeys(leaves))


# ----------------------------------------------------------------- what each layout needs, or one line why not


def tp_plan(config) -> dict[str, str]:
    """The family's TP plan (meshlm style names), or a one-line error naming what is missing and what still runs.
    parallel/tensor.py checks that it implements every style the plan names."""
    fam = family(config)
    if fam.tp_plan is None:
        raise MeshlmError(
            f"tensor parallel needs a TP plan for model family {fam.model_type!r}: its config has no "
            f"base_model_tp_plan and meshlm has no override; layouts that still work: {still_working(config)}"
        )
    return fam.tp_plan


def pipeline_parts(config, what: str) -> Family:
    """The family, checked to have what cutting it into stages needs (`what`: the layout asking)."""
    fam = family(config)
    if fam.unsplittable:
        raise MeshlmError(
            f"{what} cannot cut model family {fam.model_type!r} into stages: {fam.unsplittable}; "
            f"layouts that still work: {still_working(config)}"
        )
    if not fam.layers or not fam.embed or not fam.norm:
        raise MeshlmError(
            f"{what} needs the layer list of model family {fam.model_type!r}: its config has no "
            f"base_model_pp_plan and meshlm has no override; layouts that still work: {still_working(config)}"
        )
    return fam


def check_sequence_parallel(config) -> None:
    """One line when the family's blocks cannot take slices of the sequence (--parallel.sequence-parallel)."""
    fam = family(config)
    if fam.no_sequence_parallel:
        raise MeshlmError(
            f"--parallel.sequence-parallel cannot split model family {fam.model_type!r} along the sequence: "
            f"{fam.no_sequence_parallel}; drop --parallel.sequence-parallel (--parallel.tp alone works)"
        )


def still_working(config, tp: bool = True) -> str:
    """The layouts a family runs under (for an error about one it does not); `tp`: count a TP plan it has."""
    from meshlm.parallel.tensor_styles import STYLES

    fam = family(config)
    plan = fam.tp_plan
    splits = tp and plan is not None and all(s in STYLES for s in plan.values())
    extra = ["--parallel.tp"] if splits else []
    extra += ["--parallel.pp", "layer-split"] if fam.layers and fam.embed and fam.norm and not fam.unsplittable else []
    return ", ".join([DATA_PARALLEL, *extra])


def lora_targets(config) -> list[str]:
    fam = family(config)
    if not fam.lora_targets:
        raise MeshlmError(
            f"no default LoRA targets for model family {fam.model_type!r} (its TP plan names no Linear "
            f"projections); name them with --lora.targets"
        )
    return list(fam.lora_targets)


# ----------------------------------------------------------------- a built model's parts


def decoder(model: nn.Module) -> nn.Module:
    """The causal LM's base model (transformers' `base_model_prefix` attribute; Llama 4's text model names the
    prefix of its multimodal model, language_model, and holds its decoder as `model`)."""
    found = getattr(model, model.base_model_prefix, None)
    return found if found is not None else model.model


def head_name(model: nn.Module) -> str | None:
    """The attribute of the causal LM that holds the LM head (lm_head, embed_out, ...)."""
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_children() if m is head), None) if head is not None else None


def tied(model: nn.Module) -> bool:
    """True when the LM head shares its weight with the token embedding (transformers' `_tied_weights_keys`)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


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


# ----------------------------------------------------------------- what a decoder's own forward does around its parts
# A pipeline stage runs the parts itself (models/stages.py), so it repeats what transformers' forward adds.


def layer_type(config, layer: int) -> str:
    """Layer `layer`'s attention type: the config's layer_types (Gemma 2/3, Qwen 2, SmolLM 3), else sliding
    everywhere when the config sets a window (Mistral, Phi-3, StarCoder 2), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def cache_argument(block: nn.Module) -> str:
    """The name a block takes its KV cache under: past_key_values, or layer_past (GPT-NeoX, GPT-J, Falcon...)."""
    params = inspect.signature(block.forward).parameters
    return "layer_past" if "layer_past" in params and "past_key_values" not in params else "past_key_values"


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


# ----------------------------------------------------------------- what the planner needs


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
        moe_layers=_moe_layers(config, layers) if experts else 0,
        layer_types=tuple(types) if types else ("full_attention",) * layers,
    )


def _moe_layers(config, layers: int) -> int:
    """Layers with experts: all, except Qwen-MoE's mlp_only_layers and every decoder_sparse_step-th, and
    DeepSeek's first_k_dense_replace dense layers."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    first_dense = getattr(config, "first_k_dense_replace", None) or 0
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense)
