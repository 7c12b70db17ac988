"""Fused projections held as their parts: Phi-3's qkv_proj ([q | k | v]) and gate_up_proj ([gate | up]).

A fused projection's output is the concatenation of its parts' outputs. Tensor parallel must give each rank
its own heads of q, of k and of v (and its own columns of gate and of up); a plain column split of the
fused weight would give rank 0 all of q and part of k, and transformers' plan gathers the whole output to
split it again. meshlm instead holds each part as its own nn.Linear inside a `FusedParts` module, in every
layout, so each part splits column-wise like Llama's separate projections and the concatenated local outputs
are exactly what the attention (with its per-rank head counts) and the gated MLP expect: no gather.

The parts are meshlm's names (`qkv_proj.q_proj.weight`); transformers' checkpoints hold the fused tensor
(`qkv_proj.weight`). The two meet at the edges, as transformers' own Split / Concatenate conversions do: the
per-shard reader reads a part as a block of the fused tensor's rows (`checkpoint_rows`), export writes the
concatenation (`fused_tensors`), and a model built with real weights is split by copying.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.models.families import decoder, facts, family


class FusedParts(nn.Module):
    """A fused Linear as its parts: forward is [part_0(x) | part_1(x) | ...], the fused Linear's output."""

    def __init__(self, parts: dict[str, nn.Linear]):
        super().__init__()
        self.names = list(parts)
        for name, part in parts.items():
            setattr(self, name, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self, n)(x) for n in self.names], dim=-1)

    def rows(self, part: str) -> int:
        """Where `part`'s rows start in the fused weight."""
        return sum(getattr(self, n).out_features for n in self.names[: self.names.index(part)])


def _sizes(config, units: dict[str, str]) -> dict[str, int]:
    f = facts(config)
    per_unit = {"heads": f.heads * f.head_dim, "kv_heads": f.kv_heads * f.head_dim, "mlp": f.mlp}
    return {name: per_unit[unit] for name, unit in units.items()}


def split_fused(model: nn.Module) -> nn.Module:
    """Replace the family's fused projections (registry field `fused`: build_model calls this for a family that has
    some) by FusedParts, in place. On the meta device only shapes change; a model with weights has them copied into
    the parts."""
    fam = family(model.config)
    for block in getattr(decoder(model), fam.layers):
        for path, units in fam.fused.items():
            parent_path, _, attr = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            whole = getattr(parent, attr)
            if isinstance(whole, FusedParts):
                continue
            setattr(parent, attr, _parts_of(whole, _sizes(model.config, units)))
    return model


def _parts_of(whole: nn.Linear, sizes: dict[str, int]) -> FusedParts:
    device, dtype = whole.weight.device, whole.weight.dtype
    parts, start = {}, 0
    for name, n in sizes.items():
        part = nn.Linear(whole.in_features, n, bias=whole.bias is not None, device=device, dtype=dtype)
        if device.type != "meta":
            with torch.no_grad():
                part.weight.copy_(whole.weight[start : start + n])
                if whole.bias is not None:
                    part.bias.copy_(whole.bias[start : start + n])
        parts[name], start = part, start + n
    if start != whole.out_features:
        raise ValueError(f"parts {sizes} do not add up to the fused projection's {whole.out_features} outputs")
    return FusedParts(parts)


def join_fused(model: nn.Module) -> nn.Module:
    """The inverse of split_fused on a model with weights (a merged LoRA model before save_pretrained): each
    FusedParts becomes the fused nn.Linear transformers' class has, its weight the parts' concatenation."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedParts):
            parts = [getattr(module, n) for n in module.names]
            first = parts[0]
            whole = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None)
            with torch.no_grad():
                whole.weight.copy_(torch.cat([p.weight for p in parts]))
                if first.bias is not None:
                    whole.bias.copy_(torch.cat([p.bias for p in parts]))
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, whole.to(first.weight.dtype))
    return model


def checkpoint_rows(model: nn.Module, name: str) -> tuple[str, int] | None:
    """For a part's tensor (`...qkv_proj.k_proj.weight`): the fused tensor's name in transformers' checkpoints
    and the row its block starts at; None for any other tensor."""
    owner_path, _, attr = name.rpartition(".")
    fused_path, _, part = owner_path.rpartition(".")
    try:
        owner = model.get_submodule(fused_path)
    except AttributeError:
        return None
    if not isinstance(owner, FusedParts) or part not in owner.names:
        return None
    return f"{fused_path}.{attr}", owner.rows(part)


def fused_tensors(model: nn.Module, names: list[str]) -> dict[str, list[str]]:
    """Export's view: transformers' name of each fused tensor -> the names of its parts' tensors, in order.
    `names` are the model's tensor names; those not in a fused projection map to themselves."""
    out: dict[str, list[str]] = {}
    for name in names:
        whole = checkpoint_rows(model, name)
        out.setdefault(whole[0] if whole else name, []).append(name)
    return out
