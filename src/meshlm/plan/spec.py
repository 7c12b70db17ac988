"""What the planner is asked about: the model (the cluster is plan/cluster.py's, the job plan/job.py's).

A model's parameters are counted on the meta device from its transformers config
(a preset, a local directory, a hub id, or raw dimensions), so a 70B model is
planned in a second without reading a weight, and the count is the exact one the
trainer will build (padding of the embeddings and tied weights included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshlm.errors import MeshlmError
from meshlm.plan.presets import MOE_PRESETS, PRESETS, TINY


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the planner needs it. Parameter counts are exact (meta-device build)."""

    name: str
    family: str  # "llama": RMSNorm, gated SiLU MLP, rotary; "gpt2": LayerNorm, GELU MLP, learned positions
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int  # MLP width (intermediate size)
    vocab: int
    max_positions: int
    tied: bool  # LM head shares the input embedding
    dropout: bool  # GPT-2 style residual/embedding dropout is on (its masks are activations too)
    params: int  # everything
    layer_params: int  # one transformer block
    layer_matmul: int  # of which in matrices (what TP shards and autocast copies to bf16)
    embed_params: int  # input embedding (+ learned positions)
    head_params: int  # final norm + untied LM head
    buffer_bytes: int  # module buffers (rotary frequencies...): DDP broadcasts them before every forward
    run_as: tuple = ()  # `meshlm train` options that build this model
    buildable: bool = True  # False when given by a parameter count (--params): no dimensions to build it from
    head_size: int = 0  # per attention head, where the config sets it apart from hidden / heads (Gemma)
    experts: int = 0  # routed experts per MoE block (0: dense)
    active_experts: int = 0  # experts each token goes through
    expert_params: int = 0  # every MoE layer's routed experts together (whole experts: TP and EP split them)
    inactive_params: int = 0  # of which a token does not compute with (parallel/expert.py inactive_expert_params)
    expert_mlp: int = 0  # one expert's MLP width
    tp_attention: bool = True  # the family's TP plan splits attention (a plan with MLP entries only does not)
    layer_whole_matmul: int = 0  # of layer_matmul, what TP keeps whole on every rank (MLA's latents, routers)
    hf_config: object = field(default=None, compare=False, hash=False, repr=False)  # what --simulate builds

    @property
    def expert_layer_params(self) -> int:
        """One layer's experts, averaged over the layers (some families keep dense layers)."""
        return self.expert_params // self.layers

    @property
    def active_params(self) -> int:
        """What one token computes with: a mixture of experts runs k of its E experts per layer."""
        return self.params - self.inactive_params

    def layer_matmul_per_rank(self, tp: int) -> int:
        """One block's matrices on a rank of `tp`: the split ones' share and every whole one."""
        return (self.layer_matmul - self.layer_whole_matmul) // tp + self.layer_whole_matmul

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


def count_params(hf_config) -> dict:
    """Build the model on the meta device (no memory, no weights) and count its parts."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=True)
        except ValueError:  # not a causal language model (T5, BERT-style encoders...)
            raise MeshlmError(
                f"meshlm builds causal language models (transformers' AutoModelForCausalLM), and a "
                f"{hf_config.model_type} model is not one; pick a decoder-only model (llama, mistral, qwen2, gpt2)"
            ) from None
    n_layers = hf_config.num_hidden_layers
    blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers), None)
    if blocks is None:
        raise MeshlmError(f"cannot find the {n_layers} transformer blocks of a {hf_config.model_type} model")
    in_blocks = {id(p) for p in blocks.parameters()}
    embeds = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and not any(id(p) in in_blocks for p in m.parameters())
    ]
    from meshlm.parallel.expert import experts_modules, inactive_expert_params

    total = sum(p.numel() for p in model.parameters())
    # per block, averaged over the blocks (DeepSeek's first layers are dense, the rest MoE)
    layer = sum(p.numel() for p in blocks.parameters()) // n_layers
    matmul = sum(p.numel() for p in blocks.parameters() if p.ndim >= 2) // n_layers  # grouped experts are 3-D
    experts = sum(p.numel() for _, m in experts_modules(model) for p in m.parameters())
    embed = sum(p.numel() for m in embeds for p in m.parameters())
    whole = whole_under_tp(blocks, {id(p) for _, m in experts_modules(model) for p in m.parameters()}, hf_config)
    return {
        "layer_whole_matmul": whole // n_layers,
        "params": total,
        "layer_params": layer,
        "layer_matmul": matmul,
        "embed_params": embed,
        "head_params": total - sum(p.numel() for p in blocks.parameters()) - embed,
        "expert_params": experts,
        "inactive_params": inactive_expert_params(model),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "vocab": model.get_input_embeddings().weight.shape[0],
    }


def whole_under_tp(blocks, experts: set[int], hf_config) -> int:
    """The blocks' matrix parameters meshlm's TP keeps whole on every rank: modules its plan computes whole
    (multi-head latent attention's q_a_proj and kv_a_proj_with_mqa) and those it does not name (routers;
    Inkling's attention). A module with plan entries under it (Phi-3's fused parts) splits; experts split whole."""
    from fnmatch import fnmatchcase

    from meshlm.models.families import family
    from meshlm.parallel.tensor_styles import SPLITS_MATRICES

    fam = family(hf_config)
    plan = {k.removeprefix(f"{fam.layers}.*."): v for k, v in (fam.tp_plan or {}).items()}
    whole = 0
    for name, p in blocks.named_parameters():
        module = name.split(".", 1)[1].rpartition(".")[0]  # "0.self_attn.q_a_proj.weight" -> "self_attn.q_a_proj"
        if p.ndim < 2 or id(p) in experts:
            continue
        style = next((v for k, v in plan.items() if fnmatchcase(module, k)), None)
        parts = any(fnmatchcase(k, f"{module}.*") or k.startswith(f"{module}.") for k in plan)
        whole += 0 if style in SPLITS_MATRICES or (style is None and parts) else p.numel()
    return whole


def from_hf_config(name: str, c, run_as: tuple = ()) -> ModelSpec:
    """A ModelSpec from a transformers config of a decoder-only LM: its facts from the family registry."""
    from meshlm.models.families import facts, family

    try:
        f = facts(c)
    except MeshlmError as e:
        raise MeshlmError(f"{name}: {e}") from None
    counts = count_params(c)  # its vocabulary: the built embedding's rows
    dims = {k: v for k, v in _dims(f, family(c).planner_kind).items() if k != "vocab"}
    return ModelSpec(
        name=name,
        **dims,
        tied=f.tied,
        run_as=run_as,
        dropout=bool(getattr(c, "resid_pdrop", 0) or getattr(c, "embd_pdrop", 0)),
        head_size=f.head_dim,
        experts=f.experts,
        active_experts=f.active_experts,
        # a plan that leaves attention out (Inkling: its plan splits only the experts); no plan at all is --simulate's
        # refusal to make
        tp_attention=family(c).tp_plan is None or any("attn" in k for k in family(c).tp_plan),
        expert_mlp=f.expert_mlp,
        hf_config=c,
        **{k: v for k, v in counts.items()},
    )


def hf_config_from_dims(
    family: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    mlp: int,
    vocab: int,
    max_positions: int,
    tied: bool | None = None,
    dropout: float = 0.0,
):
    from meshlm.models.build import decoder_config

    dims = dict(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, mlp=mlp)
    dims.update(max_positions=max_positions, use_cache=False)
    if family == "gpt2":  # dropout 0.0 as in meshlm's built-in GPT-2; the real GPT-2 has 0.1
        drop = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        tie = True if tied is None else tied
        return decoder_config("gpt2", **dims, **drop, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie)
    return decoder_config("llama", **dims, tie_word_embeddings=bool(tied))


def load_model(model: str = TINY, **dims) -> ModelSpec:
    """A preset, `tiny` (meshlm's built-in model), a local directory or hub id (config only); `dims` that are
    not None override the model's dimensions (raw dimensions on their own start from `tiny`)."""
    from meshlm.config import Config
    from meshlm.models.build import model_config

    dims = {k: v for k, v in dims.items() if v is not None}
    if dims.get("family") not in (None, "llama", "gpt2"):
        raise MeshlmError(f"--family must be llama or gpt2, got {dims['family']!r}")
    for k, v in dims.items():
        if k != "family" and v < 1:
            raise MeshlmError(f"--{k.replace('_', '-')} must be at least 1, got {v}")
    if model == TINY:
        from meshlm.data.builtin import byte_tokenizer

        cfg = Config()
        base = _dims_of(model_config(cfg, len(byte_tokenizer())))
        name, hub, hf = TINY, "", None
    elif model in MOE_PRESETS:
        hub, make = MOE_PRESETS[model]
        name, hf = model, make()
        base = _dims_of(hf)
    elif model in PRESETS:
        hub, base = PRESETS[model]
        name, hf = model, None
    else:
        if "/" not in model and not Path(model).exists():  # not a hub id (owner/name) nor a directory: no hub wait
            raise MeshlmError(
                f"--model-name {model} is not a preset ({', '.join([TINY, *PRESETS, *MOE_PRESETS])}), a local "
                f"directory or a hub id (owner/name); or give dimensions (--arch.layers, --arch.hidden-size, ...) "
                "or --params"
            )
        hf = model_config(Config(model_name=model))  # one line when it cannot be read (the hub's retries quiet)
        name, hub = model, model
        base = _dims_of(hf)
    if hf is not None and not dims:
        return from_hf_config(name, hf, run_as=("--model-name", hub, "--pretrained"))
    d = {**base, **dims}
    if d["hidden"] % d["heads"] or d["heads"] % d["kv_heads"]:
        raise MeshlmError(
            f"--hidden {d['hidden']} must be divisible by --heads {d['heads']}, and the heads by "
            f"--kv-heads {d['kv_heads']}"
        )
    tied = getattr(hf, "tie_word_embeddings", None) if hf is not None else None
    dropout = getattr(hf, "resid_pdrop", 0.0) if hf is not None else (0.1 if model == "gpt2" else 0.0)
    if model == TINY and "vocab" not in dims:  # the built-in model, as meshlm train builds it
        c = builtin_config(d)
    else:
        c = hf_config_from_dims(tied=tied, dropout=dropout, **d)
    changed = name if not dims else f"{name} ({', '.join(f'{k}={v}' for k, v in dims.items())})"
    if model == TINY:  # the built-in model takes any dimensions but its vocabulary is the byte tokenizer's
        run_as = _arch_options(d) if "vocab" not in dims else ()
    else:
        run_as = ("--model-name", hub, "--pretrained") if not dims else ()
    return from_hf_config(changed, c, run_as=run_as)


def builtin_config(d: dict):
    """meshlm's built-in model with these dimensions: models/build.py's config (its vocabulary the byte
    tokenizer's, padded as build pads it)."""
    from meshlm.config import ArchConfig, Config
    from meshlm.data.builtin import byte_tokenizer
    from meshlm.models.build import model_config

    arch = ArchConfig(d["family"], d["hidden"], d["layers"], d["heads"], d["kv_heads"], d["mlp"], d["max_positions"])
    return model_config(Config(arch=arch), len(byte_tokenizer()))


def parse_count(option: str, text: str) -> int:
    """'7.5B', '7.5e9', '70G', '350M' -> a parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not m or float(m.group(1)) < 1:
        raise MeshlmError(f"{option}: cannot read {text!r} as a parameter count; use e.g. 7.5B, 7.5e9 or 350M")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2).lower()])


def with_param_count(spec: ModelSpec, count: int) -> ModelSpec:
    """The model at exactly `count` parameters (the ZeRO paper's tables give only that): the embedding and head
    as they are, the blocks scaled to hold the rest; activations keep the model's dimensions. Such a model
    cannot be built, so it has no `meshlm train` command."""
    rest = count - spec.embed_params - spec.head_params
    if rest < spec.layers:
        raise MeshlmError(
            f"--params {count:,} is smaller than {spec.name}'s embedding and head "
            f"({spec.embed_params + spec.head_params:,}); give more, or smaller dimensions"
        )
    scale = rest / (spec.layers * spec.layer_params)
    layer = rest // spec.layers
    return replace(
        spec,
        name=f"{spec.name} scaled to {count:,} parameters",
        params=count - rest % spec.layers,
        layer_params=layer,
        layer_matmul=min(layer, round(spec.layer_matmul * scale)),
        layer_whole_matmul=min(layer, round(spec.layer_whole_matmul * scale)),
        run_as=(),
        buildable=False,
    )


def _dims_of(c) -> dict:
    from meshlm.models.families import facts, family

    return _dims(facts(c), family(c).planner_kind)


def _dims(f, kind: str) -> dict:
    """The dimensions a model's registry facts give the planner (`kind`: its family's activation formulas)."""
    return dict(
        family=kind,
        layers=f.layers,
        hidden=f.hidden,
        heads=f.heads,
        kv_heads=f.kv_heads,
        mlp=f.mlp,
        vocab=f.vocab,
        max_positions=f.max_positions,
    )


def _arch_options(d: dict) -> tuple:
    """The built-in model with these dimensions (its vocabulary is the byte tokenizer's, padded to 320)."""
    opts = [
        "--arch.family",
        d["family"],
        "--arch.layers",
        d["layers"],
        "--arch.hidden-size",
        d["hidden"],
        "--arch.heads",
        d["heads"],
        "--arch.intermediate-size",
        d["mlp"],
        "--arch.max-positions",
        d["max_positions"],
    ]
    if d["family"] == "llama":
        opts += ["--arch.kv-heads", d["kv_heads"]]
    return tuple(map(str, opts))
