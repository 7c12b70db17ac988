"""transformers' checkpoint conversions, applied to one slice at a time.

transformers 5 loads checkpoints whose tensors are not the model's own: a Mixtral file holds
`block_sparse_moe.experts.N.w1.weight` per expert where the model has one grouped
`mlp.experts.gate_up_proj` [experts, 2 x width, hidden]; a Qwen3-MoE file holds `mlp.experts.N.gate_proj`
and `up_proj`; other families rename, fuse or split tensors. Its conversion mapping
(`get_model_conversion_mapping`: renamings, and converters made of operations such as MergeModulelist,
Concatenate, Chunk) says how, and `rename_source_key` which checkpoint key goes where.

Here the same mapping and the same key matching build, for every model tensor, a small tree over the
checkpoint's tensors (stack, concatenate, narrow, transpose) instead of running the operations on whole
tensors. Reading a slice of the model tensor reads only the parts of the stored tensors under that slice:
a rank holding experts 4-7 of gate_up_proj reads w1 and w3 of experts 4-7 and nothing else. Operations
with no slice rule here run as transformers runs them, on the whole tensors (read once, then sliced).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from meshlm.models.families import base_name

Index = tuple[slice, ...]


class Stored:
    """A tensor as the checkpoint stores it."""

    def __init__(self, ckpt, key: str):
        self.ckpt, self.key = ckpt, key

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ckpt.shape(self.key)

    def read(self, index: Index) -> torch.Tensor:
        return self.ckpt.read(self.key, index)

    def keys(self) -> list[str]:
        return [self.key]


@dataclass
class Stack:
    """torch.stack(parts, dim): MergeModulelist (one expert's tensor per part)."""

    parts: list
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape
        return (*inner[: self.dim], len(self.parts), *inner[self.dim :])

    def read(self, index: Index) -> torch.Tensor:
        d, rest = index[self.dim], index[: self.dim] + index[self.dim + 1 :]
        picked = [self.parts[i].read(rest) for i in range(d.start, d.stop)]
        if not picked:
            return torch.empty(_extent(self.shape, index))
        return torch.stack(picked, self.dim)

    def keys(self) -> list[str]:
        return [k for p in self.parts for k in p.keys()]


@dataclass
class Cat:
    """torch.cat(parts, dim): Concatenate (gate and up into gate_up)."""

    parts: list
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(shape)

    def read(self, index: Index) -> torch.Tensor:
        want, offset, pieces = index[self.dim], 0, []
        for part in self.parts:
            n = part.shape[self.dim]
            lo, hi = max(want.start, offset), min(want.stop, offset + n)
            if lo < hi:
                pieces.append(part.read(_with(index, self.dim, slice(lo - offset, hi - offset))))
            offset += n
        return torch.cat(pieces, self.dim) if pieces else torch.empty(_extent(self.shape, index))

    def keys(self) -> list[str]:
        return [k for p in self.parts for k in p.keys()]


@dataclass
class Narrow:
    """part[start : start + length] along dim: one piece of a Chunk (a fused tensor split into several)."""

    part: object
    dim: int
    start: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.part.shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def read(self, index: Index) -> torch.Tensor:
        d = index[self.dim]
        return self.part.read(_with(index, self.dim, slice(d.start + self.start, d.stop + self.start)))

    def keys(self) -> list[str]:
        return self.part.keys()


@dataclass
class Transposed:
    """part.transpose(dim0, dim1): Transpose."""

    part: object
    dim0: int
    dim1: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.part.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        return tuple(shape)

    def read(self, index: Index) -> torch.Tensor:
        swapped = list(index)
        swapped[self.dim0], swapped[self.dim1] = index[self.dim1], index[self.dim0]
        return self.part.read(tuple(swapped)).transpose(self.dim0, self.dim1)

    def keys(self) -> list[str]:
        return self.part.keys()


class Whole:
    """A target of a conversion with no slice rule here: transformers' own operations on the whole tensors
    (read when first asked, kept for the converter's other targets), then sliced."""

    def __init__(self, run, target: str, shape: tuple[int, ...], keys: list[str]):
        self.run, self.target, self.shape, self._keys = run, target, shape, keys

    def read(self, index: Index) -> torch.Tensor:
        return self.run()[self.target][index]

    def keys(self) -> list[str]:
        return self._keys


def _with(index: Index, dim: int, s: slice) -> Index:
    return (*index[:dim], s, *index[dim + 1 :])


def _extent(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index) if index else shape


def model_sources(model: nn.Module, ckpt) -> dict[str, object]:
    """Model tensor name -> how to read it from `ckpt` (its stored key or a tree over several), for every
    checkpoint key transformers' conversion mapping of `model` (a PreTrainedModel, on meta) sends somewhere
    in the model. Names absent from the result are the model's that the checkpoint does not hold."""
    from meshlm.compat_transformers import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        get_model_conversion_mapping,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    # names without LoRA's wrappers (a peft-wrapped base weight keeps its plain name in checkpoints)
    wanted = {base_name(n): t for n, t in model.state_dict(keep_vars=True).items()}
    sources: dict[str, object] = {}
    grouped: dict[str, tuple] = {}
    for key in sorted(ckpt.weight_map, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, wanted)
        if name not in wanted and key in wanted:
            name, pattern = key, None
        if name not in wanted:
            continue  # a tensor the model has no place for (transformers reports it as unexpected)
        if pattern is None:  # its key, which ckpt.read_into reads in blocks of rows (a tree it reads whole)
            sources[name] = key
        else:
            grouped.setdefault(name, (by_pattern[pattern], defaultdict(list)))[1][pattern].append(Stored(ckpt, key))
    for first, (converter, collected) in grouped.items():
        sources.update(_converted(converter, first, collected, model))
    return sources


def _converted(converter, layer_name: str, collected: dict, model: nn.Module) -> dict[str, object]:
    """The targets of one converter (full model names) as trees over its collected checkpoint tensors."""
    tree = _as_tree(converter, dict(collected), model)
    if tree is None:
        tree = _run_whole(converter, layer_name, collected, model)
    full = layer_name.replace("*.", "0.")
    prefix, _, suffix = next((full.partition(k) for k in tree if k in full), ("", "", ""))
    return {prefix + k + suffix: v for k, v in tree.items()}


def _as_tree(converter, tensors: dict, model: nn.Module) -> dict | None:
    """transformers' operations applied to trees instead of tensors; None if one has no rule here."""
    from meshlm.compat_transformers import Chunk, Concatenate, MergeModulelist, Transpose

    sources, targets = converter.source_patterns, converter.target_patterns
    for op in converter.operations:
        if type(op) is MergeModulelist:
            n = len(tensors)
            tensors = {op.get_target_pattern(n, p, targets): Stack(list(v), op.dim) for p, v in tensors.items()}
        elif type(op) is Concatenate:
            parts = [t for p in sources if p in tensors for t in _listed(tensors[p])]
            tensors = {op.get_target_pattern(targets): Cat(parts, op.dim)}
        elif type(op) is Chunk and len(tensors) == 1:
            (whole,) = _listed(next(iter(tensors.values())))
            names = op.get_target_patterns(targets, config=model.config)
            size = -(-whole.shape[op.dim] // len(names))  # torch.chunk's piece size
            tensors = {
                name: Narrow(whole, op.dim, i * size, min(size, whole.shape[op.dim] - i * size))
                for i, name in enumerate(names)
            }
        elif type(op) is Transpose and not op.check_dims and len(tensors) == 1:
            (part,) = _listed(next(iter(tensors.values())))
            tensors = {op.get_target_pattern(tensors, sources, targets): Transposed(part, op.dim0, op.dim1)}
        else:
            return None
    return {k: _listed(v)[0] for k, v in tensors.items()}


def _listed(v) -> list:
    return v if isinstance(v, list) else [v]


def _run_whole(converter, layer_name: str, collected: dict, model: nn.Module) -> dict:
    """transformers' own operations on the whole stored tensors, run once when a target is first read."""
    done: dict = {}
    keys = [k for parts in collected.values() for p in parts for k in p.keys()]

    def run() -> dict:
        if not done:
            tensors = {
                p: [s.read(tuple(slice(0, n) for n in s.shape)) for s in parts] for p, parts in collected.items()
            }
            for op in converter.operations:
                tensors = op.convert(
                    tensors,
                    source_patterns=converter.source_patterns,
                    target_patterns=converter.target_patterns,
                    full_layer_name=layer_name,
                    model=model,
                    config=model.config,
                )
            done.update({k: _listed(v)[0] for k, v in tensors.items()})
        return done

    shapes = {
        t: tuple(model.get_parameter(layer_name.replace(converter.target_patterns[0], t)).shape)
        for t in converter.target_patterns
    }
    return {t: Whole(run, t, shapes[t], keys) for t in converter.target_patterns}


def _reverse_converters(model: nn.Module) -> list:
    """The converters of transformers' save direction (as revert_weight_conversion builds them)."""
    from meshlm.compat_transformers import PrefixChange, WeightConverter, get_model_conversion_mapping

    mapping = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    return [r for r in (t.reverse_transform() for t in mapping[::-1]) if isinstance(r, WeightConverter)]


def saved_groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """`names` in groups that transformers saves together (the tensors one saved tensor is made of: q, k, v
    of a fused qkv), each a group of its own otherwise; in the order of their first member."""
    from meshlm.compat_transformers import apply_converters

    converters, groups = _reverse_converters(model), {}
    for name in names:
        key, pattern = apply_converters(name, converters)
        groups.setdefault(key if pattern is not None else name, []).append(name)
    return list(groups.values())


def saved_names(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A group of model tensors as transformers' save_pretrained writes them (its conversion reverted)."""
    from meshlm.compat_transformers import revert_weight_conversion

    return revert_weight_conversion(model, tensors)
