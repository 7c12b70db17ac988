"""LoRA adapters with peft, in every layout.

`apply_lora` injects peft's LoRA layers into the model in place
(`inject_adapter_in_model`: no PeftModel wrapper, so the module paths the TP plan,
the pipeline split and the FSDP units use stay as they were; a wrapped projection
keeps its weight under `<path>.base_layer` and adds `<path>.lora_A.default` /
`<path>.lora_B.default`). It runs right after the model is built and before any
other technique, so the adapters are ordinary parameters of their block:
pipeline stages carry them, FSDP shards them in their block's unit (FSDP2 shards
per parameter, and reduce-scatters gradients only of those that have them), DDP
and ZeRO-1 only see them (the base is frozen: `requires_grad=False`).

Tensor parallel shards an adapter the way its base layer is sharded, so the
forward adds no collective: for a column-wise base, A is replicated and B is
split by output columns (each rank adds its own columns); for a row-wise base,
A is split by input rows and B is replicated, and the adapter's partial sum is
added to the base's partial sum before the layer's one all-reduce. In backward
the replicated adapter's weight gradient is a Partial(sum) DTensor, which DTensor
all-reduces where it meets replicated tensors (gradient norm, AdamW; FSDP2 under
fsdp+tp): r x width elements per layer, small next to the activations.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshlm.config import Config, lora_on
from meshlm.errors import MeshlmError
from meshlm.models import families

ADAPTER = "default"  # peft's adapter name: the one adapter meshlm trains


def enabled(cfg: Config) -> bool:
    return lora_on(cfg.lora)


def check_strategy(cfg: Config, strategy: str) -> None:
    if enabled(cfg) and strategy == "dp":
        raise MeshlmError(
            "--lora.r needs a layout that keeps parameters in place; --strategy dp copies the model "
            "to every device each step: use --strategy ddp"
        )


def base_dtype(cfg: Config) -> torch.dtype:
    """The frozen base's storage dtype (config.py lora_base_dtype): bf16 by default under bf16 mixed precision."""
    from meshlm.config import lora_base_dtype

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[lora_base_dtype(cfg.lora.base_dtype, cfg.mixed_precision)]


def cast_base(model: nn.Module, cfg: Config) -> None:
    """Store the frozen base in base_dtype, in place, after the initial weights' twin is taken (it keeps fp32,
    so the base is the fp32 one rounded, in every layout) and before any technique allocates or shards it. Only
    the frozen floating-point parameters change: the adapters keep fp32 values (FSDP2 asks one dtype of a unit's
    trainable parameters only; its policy and autocast compute them in bf16), buffers keep theirs."""
    dtype = base_dtype(cfg)
    if not enabled(cfg) or dtype == torch.float32:
        return
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def targets(cfg: Config, model_config) -> list[str]:
    """--lora.targets, or the family's attention and MLP projections (models/families)."""
    if cfg.lora.targets:
        return [t.strip() for t in cfg.lora.targets.split(",") if t.strip()]
    return families.lora_targets(model_config)


def _linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    from meshlm.compat_transformers import Conv1D

    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}


def _widths(m: nn.Module) -> tuple[int, int]:
    return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else tuple(m.weight.shape)


def _expert_weights(model: nn.Module) -> dict[str, int]:
    """A mixture of experts' grouped weights (3-D: experts x out x in) by name, with their smaller width."""
    from meshlm.parallel.expert import experts_modules

    return {
        n: min(p.shape[1:])
        for _, m in experts_modules(model)
        for n, p in m.named_parameters(recurse=False)
        if p.ndim == 3
    }


def peft_config(cfg: Config, model: nn.Module):
    """peft's LoraConfig for this run, after checking every target against the model's linear layers and its
    experts' grouped weights (peft's target_parameters: a ParamWrapper per weight, an r-wide slice of A and B per
    expert)."""
    from peft import LoraConfig as PeftLora

    names = targets(cfg, model.config)
    linear, experts = _linear_layers(model), _expert_weights(model)
    leaves = {n.rsplit(".", 1)[-1] for n in linear}
    if not cfg.lora.targets:  # the family's defaults that this model has (dense MLPs in some blocks only)
        names = [t for t in names if t in leaves]
    missing = [t for t in names if t not in leaves and t not in experts]
    if missing:
        grouped = f"; its experts' grouped weights: {', '.join(sorted(experts))}" if experts else ""
        raise MeshlmError(
            f"--lora.targets {','.join(missing)} matches no linear layer of the model; "
            f"its linear layers are named: {', '.join(sorted(leaves))}{grouped}"
        )
    params = [t for t in names if t in experts]
    width = min(
        [min(_widths(m)) for n, m in linear.items() if n.rsplit(".", 1)[-1] in names] + [experts[t] for t in params]
    )
    if cfg.lora.r > width:
        raise MeshlmError(
            f"--lora.r {cfg.lora.r} is larger than the smallest target's width {width}; use --lora.r {width} or less"
        )
    modules = [t for t in names if t in leaves]
    experts_leaf = (families.family(model.config).experts or "").rsplit(".", 1)[-1]
    return PeftLora(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=modules or None,
        target_parameters=[f"{experts_leaf}.{t}" for t in params] or None,
        fan_in_fan_out=families.family(model.config).conv1d,
        bias="none",
    )


def check_expert_targets(cfg: Config, model_config) -> None:
    """Before any rank starts (layout.resolve): what LoRA on a mixture of experts' grouped weights cannot do, in
    one line. Their names come from the model built on the meta device, only where it has experts and the run
    asks for dropout."""
    if not (enabled(cfg) and cfg.lora.targets and families.facts(model_config).experts and cfg.lora.dropout):
        return
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = [
            t
            for t in targets(cfg, model_config)
            if t in _expert_weights(AutoModelForCausalLM.from_config(model_config))
        ]
    if params:
        raise MeshlmError(
            f"--lora.targets {','.join(params)} adapts grouped expert weights, whose peft adapters take no "
            f"dropout (it cannot be factored out of the weight): use --lora.dropout 0"
        )


def apply_lora(model: nn.Module, cfg: Config) -> nn.Module:
    """Inject the adapters in place and freeze everything else. On the meta device (every training layout)
    the adapters get their values with the rest of the model (initial_value, through models/materialize.py);
    a model that already has weights gets the same values here."""
    if not enabled(cfg):
        return model
    from peft import inject_adapter_in_model

    lcfg = peft_config(cfg, model)
    with torch.random.fork_rng(devices=[]):  # peft's own draws must not move the global generator
        inject_adapter_in_model(lcfg, model, adapter_name=ADAPTER)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(is_adapter(name))
            if is_adapter(name) and not p.is_meta:
                p.copy_(initial_value(name, p, cfg.seed))
    return model


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model alone while inside (DPO's reference, objectives/dpo.py): peft's enable_adapters(False) on every
    adapted layer, no copy of anything. peft also clears the adapters' requires_grad; every parameter's flag is
    put back at once, because FSDP2 and DDP act on what they find there (the forward inside needs no gradients)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for m in layers:
        m.enable_adapters(False)
    for p, flag in flags:
        p.requires_grad_(flag)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _seeded(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def initial_value(name: str, like: torch.Tensor, seed: int) -> torch.Tensor | None:
    """An adapter's initial value, the same in every layout and on every device (models/materialize.py fills
    each rank's slice from it): lora_A as peft draws it (Kaiming uniform, a = sqrt(5)) from a generator seeded
    by (seed, name), lora_B zeros, so training starts from the base model. None for the base's own tensors."""
    if ".lora_B." in name:
        return torch.zeros(like.shape, dtype=like.dtype)
    if ".lora_A." in name:
        t = torch.empty(like.shape, dtype=like.dtype)
        return nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=_seeded(seed, name))
    return None


def base_fingerprint(cfg: Config) -> dict:
    """{"lora_base": what the frozen base is} for a LoRA run (a checkpoint holds adapters only, so resuming
    and export must find the same base); {} otherwise (models/build.py weights_digest)."""
    if not enabled(cfg):
        return {}
    from meshlm.models.build import weights_digest

    return {"lora_base": weights_digest(cfg)}


# ---------------------------------------------------------------- checkpoints


def saved_part(model_sd: dict) -> dict:
    """What a checkpoint stores of the model: the adapters alone when there are any (the base is the
    run's --model-name/--seed, checked by its fingerprint), else everything."""
    adapters = {k: v for k, v in model_sd.items() if is_adapter(k)}
    return adapters or model_sd


# ---------------------------------------------------------------- tensor parallel


def _shard(placements: dict[str, list]):
    """partition_fn for distribute_module: placements by the submodule path's first part."""

    def partition(name, module, mesh):
        kind = name.split(".", 1)[0]
        if kind not in placements:
            return
        for pname, param in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(param, mesh, placements[kind][pname])
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    return partition


class LoraColwise(ParallelStyle):
    """A peft LoRA Linear whose base is column-wise: base and B split by output rows of their weight, A whole."""

    def _apply(self, module, mesh):
        def enter(mod, args, mesh):
            x = args[0]
            x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x.redistribute(placements=[Replicate()]), *args[1:])

        placements = {
            "base_layer": {"weight": [Shard(0)], "bias": [Shard(0)]},
            "lora_A": {"weight": [Replicate()]},
            "lora_B": {"weight": [Shard(0)]},
        }
        return distribute_module(module, mesh, _shard(placements), enter, lambda mod, out, mesh: out.to_local())


class LoraRowwise(ParallelStyle):
    """A peft LoRA Linear whose base is row-wise: base and A split by input columns, B whole. Base and
    adapter outputs are partial sums, added before the one all-reduce (reduce-scatter under SP)."""

    def __init__(self, output_layout):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module, mesh):
        def enter(mod, args, mesh):
            x = args[0]
            return (
                x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(-1)], run_check=False),
                *args[1:],
            )

        def leave(mod, out, mesh):
            return out.redistribute(placements=[self.output_layout]).to_local()

        placements = {
            "base_layer": {"weight": [Shard(1)], "bias": [Replicate()]},
            "lora_A": {"weight": [Shard(1)]},
            "lora_B": {"weight": [Replicate()]},
        }
        return distribute_module(module, mesh, _shard(placements), enter, leave)


def adapt_tp_plan(decoder: nn.Module, plan: dict, layer: str) -> None:
    """Replace the style of every LoRA-wrapped projection in a TP plan (patterns with `*` for the layer
    index; `layer` is one present index to resolve them with) by the LoRA style of the same split."""
    from peft.tuners.lora import LoraLayer

    for pattern, style in list(plan.items()):
        if "*" not in pattern:
            continue
        try:
            module = decoder.get_submodule(pattern.replace("*", layer))
        except AttributeError:
            continue
        if not isinstance(module, LoraLayer):
            continue
        if type(style) is ColwiseParallel:
            plan[pattern] = LoraColwise()
        elif type(style) is RowwiseParallel:
            plan[pattern] = LoraRowwise(style.output_layouts[0])
        else:
            raise MeshlmError(
                f"LoRA under tensor parallel supports nn.Linear projections; {pattern} uses "
                f"{type(style).__name__}: leave it out of --lora.targets or use --parallel.tp 1"
            )


# ---------------------------------------------------------------- memory


def state_breakdown(engine, optimizer) -> dict:
    """model_state_bytes by kind, as this rank holds them now (local shards; between steps): the frozen
    base at its dtype, the adapters, their gradients, their optimizer states."""
    from meshlm.engines.base import storage_bytes

    params = list(engine.model.parameters())
    return {
        "frozen_bytes": storage_bytes(p for p in params if not p.requires_grad),
        "adapter_bytes": storage_bytes(p for p in params if p.requires_grad),
        "grad_bytes": storage_bytes(p.grad for p in params),
        "optim_bytes": storage_bytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0
        ),
    }
