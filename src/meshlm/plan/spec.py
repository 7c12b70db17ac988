"""What the planner is asked about: the model, the cluster and the job; and the parsing of their numbers.

A model's parameters are counted on the meta device from its transformers config
(a preset, a local directory, a hub id, or raw dimensions), so a 70B model is
planned in a second without reading a weight, and the count is the exact one the
trainer will build (padding of the embeddings and tied weights included).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshlm.errors import MeshlmError
from meshlm.hardware import FLOAT8_FLOPS, GPUS, PCIE_ONLY

# Presets are copies of well-known configs, so planning needs no network; the command runs their hub id, an
# ungated copy of the weights where one exists (meta-llama's own repositories need an access request).
PRESETS = {
    "llama-7b": (
        "NousResearch/Llama-2-7b-hf",
        dict(family="llama", layers=32, hidden=4096, heads=32, kv_heads=32, mlp=11008, vocab=32000, max_positions=4096),
    ),
    "llama-13b": (
        "NousResearch/Llama-2-13b-hf",
        dict(family="llama", layers=40, hidden=5120, heads=40, kv_heads=40, mlp=13824, vocab=32000, max_positions=4096),
    ),
    "llama-70b": (
        "NousResearch/Llama-2-70b-hf",
        dict(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8, mlp=28672, vocab=32000, max_positions=4096),
    ),
    "llama-405b": (  # Llama 3.1 405B's dimensions (its RoPE scaling does not change the memory)
        "meta-llama/Llama-3.1-405B",
        dict(
            family="llama",
            layers=126,
            hidden=16384,
            heads=128,
            kv_heads=8,
            mlp=53248,
            vocab=128256,
            max_positions=131072,
        ),
    ),
    "gpt2": (
        "openai-community/gpt2",
        dict(family="gpt2", layers=12, hidden=768, heads=12, kv_heads=12, mlp=3072, vocab=50257, max_positions=1024),
    ),
}
TINY = "tiny"  # meshlm's built-in model (`meshlm train` without --model-name)


def _qwen3_235b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(  # Qwen/Qwen3-235B-A22B's config.json
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_cache=False,
    )


def _deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(  # deepseek-ai/DeepSeek-V3's dimensions (MLA attention; no TP plan for it in meshlm)
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        use_cache=False,
    )


# Mixtures of experts, as their transformers configs (their dimensions alone do not say the model).
MOE_PRESETS = {
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", _qwen3_235b),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", _deepseek_v3),
}

# Achievable bytes/s per GPU on a ring step (bus bandwidth), and a latency per collective call.
LINKS = {
    "nvlink": (300e9, 10e-6),  # NVLink 4 (H100): 450 GB/s per direction, ~300 reached by NCCL rings
    "pcie": (24e9, 15e-6),  # PCIe 4.0 x16
    "infiniband": (45e9, 25e-6),  # one 400 Gb/s NDR NIC per GPU (DGX H100 layout)
    "ethernet": (12e9, 50e-6),  # 100 GbE per GPU
}

# --device cpu: the ranks are gloo processes of one machine, talking over loopback TCP (a rough rate and latency),
# their optimizer steps reading RAM (a rough rate for a desktop's DDR4/DDR5)
CPU_LINK = (2e9, 50e-6)
CPU_RAM_BYTES_PER_S = 20e9


def cpu_device(ranks: int) -> tuple[int, float]:
    """(memory, fp32 FLOP/s) of one of `ranks` CPU ranks on this machine: its share of the machine's RAM, and the
    fp32 matmul rate measured here with the threads a rank gets (CPU ranks compute in fp32; bf16 is no faster)."""
    import os
    import time

    import torch

    from meshlm.launch import threads_per_rank

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
    threads, n = torch.get_num_threads(), 512
    torch.set_num_threads(threads_per_rank(ranks))
    try:
        a = torch.randn(n, n)
        best = math.inf
        for _ in range(5):  # the best of a few: a loaded machine's slowest runs say little about its rate
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return memory, 2 * n**3 / best


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(option: str, text: str) -> int:
    """'80GiB', '80GB', '80e9', '1.5TiB' -> bytes; anything else is a one-line error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise MeshlmError(f"{option}: cannot read {text!r} as a size; use e.g. 80GiB, 80GB or 80e9")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bandwidth(option: str, text: str) -> tuple[float, float]:
    """A preset (nvlink, pcie, infiniband, ethernet) or bytes/s: '50GB/s', '400Gb/s', '400Gbps', '50e9'.
    Returns (bytes/s, latency per collective call in seconds)."""
    t = str(text).strip()
    if t.lower() in LINKS:
        return LINKS[t.lower()]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(B|b|bit|bps)?(/s)?", t)
    if not m or float(m.group(1)) <= 0:
        raise MeshlmError(
            f"{option}: cannot read {text!r}; use {', '.join(LINKS)} or a rate such as 50GB/s, "
            f"400Gb/s or 50e9 (bytes/s)"
        )
    rate = float(m.group(1)) * _UNITS[m.group(2).lower()]
    bits = m.group(3) in ("b", "bit", "bps")
    return (rate / 8 if bits else rate), LINKS["infiniband"][1]


def parse_flops(option: str, text: str) -> float:
    """'989e12', '989T', '989TFLOPS', '989 TFLOP/s' -> FLOP/s."""
    m = re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtTpP]?)(?:FLOPS|FLOP/s|flops|flop/s)?\s*", str(text)
    )
    if not m or float(m.group(1)) <= 0:
        raise MeshlmError(f"{option}: cannot read {text!r} as FLOP/s; use e.g. 989e12 or 989T")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}[m.group(2).lower()]


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
    counts = count_params(c)
    return ModelSpec(
        name=name,
        family=family(c).planner_kind,
        layers=f.layers,
        hidden=f.hidden,
        heads=f.heads,
        kv_heads=f.kv_heads,
        mlp=f.mlp,
        max_positions=f.max_positions,
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
    from transformers import GPT2Config, LlamaConfig

    if family == "gpt2":  # dropout 0.0 as in meshlm's built-in GPT-2; the real GPT-2 has 0.1
        return GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=mlp,
            n_positions=max_positions,
            tie_word_embeddings=True if tied is None else tied,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        )
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(tied),
        use_cache=False,
    )


DIMS = ("family", "layers", "hidden", "heads", "kv_heads", "mlp", "vocab", "max_positions")


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
    c = hf_config_from_dims(tied=tied, dropout=dropout, **d)
    changed = name if not dims else f"{name} ({', '.join(f'{k}={v}' for k, v in dims.items())})"
    if model == TINY:  # the built-in model takes any dimensions but its vocabulary is the byte tokenizer's
        run_as = _arch_options(d) if "vocab" not in dims else ()
    else:
        run_as = ("--model-name", hub, "--pretrained") if not dims else ()
    return from_hf_config(changed, c, run_as=run_as)


def check_degrees(spec: ModelSpec, tp: int | None, pp: int | None) -> None:
    """One-line errors for a --tp / --pp that cannot split this model (tensor parallel splits heads, kv heads and
    the MLP width; the vocabulary may split unevenly; pipeline parallel whole blocks)."""
    if tp and tp > 1:
        if spec.experts and spec.experts % tp:
            raise MeshlmError(
                f"--tp {tp} does not divide {spec.name}'s {spec.experts} experts (TP splits whole experts)"
            )
        for what, n in (("attention heads", spec.heads), ("kv heads", spec.kv_heads), ("MLP width", spec.mlp)):
            if n % tp:
                raise MeshlmError(
                    f"--tp {tp} does not divide {spec.name}'s {n} {what}; pick a tensor-parallel degree "
                    f"that divides {spec.heads} heads, {spec.kv_heads} kv heads and MLP {spec.mlp}"
                )
    if pp and pp > spec.layers:
        raise MeshlmError(
            f"--pp {pp} is more than {spec.name}'s {spec.layers} blocks; use at most {spec.layers} pipeline stages"
        )


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

    f = facts(c)
    return dict(
        family=family(c).planner_kind,
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


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "h100"
    gpu_memory: int = GPUS["h100"][0]
    peak_flops: float = GPUS["h100"][1]  # per GPU, for the job's precision
    float8_flops: float = FLOAT8_FLOPS["h100"]  # per GPU, float8 matmuls (--float8); 0: none
    hbm_bw: float = GPUS["h100"][3]
    intra: tuple = LINKS["nvlink"]  # (bytes/s, latency) between GPUs of a node
    inter: tuple = LINKS["infiniband"]  # between nodes
    host: tuple = LINKS["pcie"]  # GPU <-> CPU (offload)
    cpu_memory: int = 2 * 2**40  # per node

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def make_cluster(
    nodes=1,
    gpus_per_node=8,
    gpu="h100",
    gpu_memory=None,
    peak_flops=None,
    intra="",
    inter="infiniband",
    cpu_memory="2TiB",
    precision="bf16",
) -> Cluster:
    if gpu == "cpu":  # --device cpu
        mem, fp32 = cpu_device(nodes * gpus_per_node)
        return Cluster(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            gpu=gpu,
            gpu_memory=parse_size("--gpu-memory", gpu_memory) if gpu_memory else mem,
            peak_flops=parse_flops("--peak-flops", peak_flops) if peak_flops else fp32,
            float8_flops=0.0,
            hbm_bw=CPU_RAM_BYTES_PER_S,
            intra=CPU_LINK,
            inter=parse_bandwidth("--inter-node", inter),
            cpu_memory=mem,
        )
    if gpu not in GPUS:
        raise MeshlmError(
            f"--gpu must be one of {', '.join(GPUS)}, got {gpu!r} (or give --gpu-memory and --peak-flops)"
        )
    if nodes < 1 or gpus_per_node < 1:
        raise MeshlmError("--nodes and --gpus-per-node must be at least 1")
    mem, bf16, fp32, hbm = GPUS[gpu]
    return Cluster(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        gpu_memory=parse_size("--gpu-memory", gpu_memory) if gpu_memory else mem,
        peak_flops=parse_flops("--peak-flops", peak_flops) if peak_flops else (bf16 if precision == "bf16" else fp32),
        float8_flops=FLOAT8_FLOPS.get(gpu, 0.0),
        hbm_bw=hbm,
        intra=parse_bandwidth("--intra-node", intra or ("pcie" if gpu in PCIE_ONLY else "nvlink")),
        inter=parse_bandwidth("--inter-node", inter),
        cpu_memory=parse_size("--cpu-memory", cpu_memory),
    )


@dataclass(frozen=True)
class Job:
    seq_length: int = 2048
    micro_batch: int = 1  # sequences per rank per forward pass
    global_batch: int = 0  # sequences per optimizer step (0: micro_batch x GPUs)
    precision: str = "bf16"  # "fp32" or "bf16" (bf16 compute, fp32 master weights: meshlm's mixed precision)
    optimizer: str = "adamw"  # "adamw" (2 fp32 states) or "sgd" (momentum: 1 fp32 state)
    attention: str = "fused"  # "fused" (SDPA flash/memory-efficient: no s x s scores) or "eager"
    margin: float = 0.10  # GPU memory kept free for the CUDA context, allocator fragmentation, NCCL
    lora_r: int = 0  # LoRA adapter rank (0: full fine-tuning); plan/memory.py lora_states
    objective: str = "sft"  # "sft" or "dpo" (train/dpo.py: a reference forward per micro-batch)
    precompute_reference: bool = False  # dpo: the reference's log-probabilities come from the cache
    chunked_loss: str = "auto"  # --chunked-loss: the LM head's loss over chunks of tokens (parallel/loss.py)
    activation_offload: bool = False  # --activation-offload: saved activations in host memory (parallel/offload.py)
    lora_targets: str = ""  # --lora.targets (comma-separated; "": the family's defaults, no expert weights)
    cp_attention: str = "auto"  # --parallel.cp-attention: how cp ranks attend across the split (parallel/context.py)
    float8: str = "off"  # --float8 tensorwise|rowwise: the blocks' Linear layers in float8 (parallel/float8.py)
    cpu_ranks: bool = False  # --device cpu: the ranks are CPU processes (glibc's heap: plan/memory.py heap_retained)

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def reference_forward(self) -> bool:
        """DPO runs the reference's forward every step (unless precomputed): LoRA's base or a frozen copy."""
        return self.objective == "dpo" and not self.precompute_reference

    @property
    def reference_copy(self) -> bool:
        """DPO holds a frozen copy of the model (without LoRA, whose reference is its own base)."""
        return self.reference_forward and not self.lora_r

    def check(self, spec: ModelSpec, world: int) -> "Job":
        from meshlm.config import CP_ATTENTION, FLOAT8_RECIPES, OBJECTIVES

        if self.precision not in ("fp32", "bf16"):
            raise MeshlmError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise MeshlmError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        if self.cp_attention not in CP_ATTENTION:
            raise MeshlmError(f"--cp-attention must be one of {', '.join(CP_ATTENTION)}, got {self.cp_attention!r}")
        if self.attention not in ("fused", "eager"):
            raise MeshlmError(f"--attention must be fused or eager, got {self.attention!r}")
        if self.seq_length < 1 or self.micro_batch < 1 or self.global_batch < 0:
            raise MeshlmError(
                "--seq-length and --micro-batch-size must be at least 1, --global-batch-size not negative"
            )
        if spec.max_positions and self.seq_length > spec.max_positions:
            raise MeshlmError(
                f"--seq-length {self.seq_length} is larger than {spec.name}'s {spec.max_positions} "
                f"positions; use --seq-length {spec.max_positions} or less"
            )
        if not 0 <= self.margin < 1:
            raise MeshlmError(f"--margin must be in [0, 1), got {self.margin}")
        if self.objective not in OBJECTIVES:
            raise MeshlmError(f"--objective must be sft or dpo, got {self.objective!r}")
        from meshlm.config import check_chunked_loss

        check_chunked_loss(self.chunked_loss, self.objective)
        if self.float8 not in FLOAT8_RECIPES:
            raise MeshlmError(f"--float8 must be off, tensorwise or rowwise, got {self.float8!r}")
        return replace(self, global_batch=self.global_batch or self.micro_batch * world)
