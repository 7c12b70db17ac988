"""The model-family registry: everything meshlm knows about a transformers decoder family, in one place.

For a config's `model_type` it says where the token embedding, the blocks, the final norm and the rotary
embedding live (the pipeline cut points and the layer-split units), the tensor-parallel plan in meshlm's
DTensor styles (parallel/tensor.py turns the names into styles), LoRA's default targets, and what each layout
needs of it, or one line why a layout cannot run it.

The default entry is read from transformers' own metadata: the config's `base_model_tp_plan` (module path ->
style) and `base_model_pp_plan` (embedding modules, the layer list and the final norm, in order).
`entries.ENTRIES` holds the few families where that metadata is missing (GPT-2) or where meshlm does better
than transformers' style (see docs/families.md), each in one entry; `register()` takes the same fields from
the user's own code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from meshlm.errors import MeshlmError
from meshlm.models.families.entries import ENTRIES
from meshlm.models.families.facts import moe_layers

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
    planner_kind: str = "llama"  # activation formulas (plan/activations.py): llama (RMSNorm, gated MLP), gpt2
    # Fused projections held as parts (models/fused.py): block path -> {part: rows in units of heads, kv_heads, mlp}
    fused: dict[str, dict[str, str]] | None = None
    experts: str | None = None  # a mixture of experts' grouped experts module ("layers.*.mlp.experts"): ep plan
    # Why the decoder cannot be cut into stages although it has a layer list (its forward does more between
    # blocks than a stage repeats): pipeline parallel and layer split refuse with it. None: it can.
    unsplittable: str | None = None
    # Why its blocks cannot run on slices of the sequence under --parallel.sequence-parallel (None: they can).
    no_sequence_parallel: str | None = None
    source: str = "transformers"  # where the entry came from: transformers' metadata, an override, register()


_REGISTERED: dict[str, Family] = {}
ENTRY_ONLY = ("plan_entries",)  # an entry's keys that are no field of Family (entries.py says what they do)


def register(model_type: str, **entry) -> Family:
    """Add or replace a family from the user's own code (a model class registered with transformers' Auto
    classes): fields of `Family` (and `plan_entries`, as in entries.py), over what transformers' metadata of its
    config class gives."""
    from transformers import CONFIG_MAPPING

    unknown = set(entry) - {f.name for f in fields(Family)} - set(ENTRY_ONLY)
    if unknown:
        raise ValueError(f"register({model_type!r}): unknown fields {sorted(unknown)}")
    over = entry.get("plan_entries", ENTRIES.get(model_type, {}).get("plan_entries"))
    known = model_type in CONFIG_MAPPING
    base = _from_metadata(CONFIG_MAPPING[model_type], over) if known else Family(model_type)
    _REGISTERED[model_type] = _with(base, entry, "register()")
    return _REGISTERED[model_type]


def family(config) -> Family:
    """The registry's entry for a model config: registered, else transformers' metadata with meshlm's entry."""
    kind = config.model_type
    if kind in _REGISTERED:
        return _REGISTERED[kind]
    entry = ENTRIES.get(kind)
    fam = _from_metadata(config, entry and entry.get("plan_entries"))
    return _with(fam, entry, "meshlm override") if entry else fam


def _with(fam: Family, entry: dict, source: str) -> Family:
    """`fam` with the fields `entry` names; LoRA's targets follow a new TP plan unless the entry names them."""
    targets = entry.get("lora_targets") or _linear_leaves(entry.get("tp_plan", fam.tp_plan))
    named = {k: v for k, v in entry.items() if k not in ENTRY_ONLY}
    return replace(fam, **{**named, "lora_targets": targets, "source": source})


def _from_metadata(config, plan_entries: dict[str, str] | None = None) -> Family:
    """What transformers' plans say (a config class or instance: the plans are class attributes), with
    `plan_entries` put over its TP plan."""
    kind = config.model_type
    tp = {**(getattr(config, "base_model_tp_plan", None) or {}), **(plan_entries or {})} or None
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
    return isinstance(layers, int) and not isinstance(config, type) and moe_layers(config, layers) == layers


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
