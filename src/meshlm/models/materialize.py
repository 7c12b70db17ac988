"""Give a model built on the meta device its weights, each rank allocating only what its layout gave it.

The flow (as torchtitan's): build on meta -> pipeline split, TP, AC, compile, FSDP (all on meta) ->
`materialize`. Every tensor the rank holds is filled one at a time: its full value is made on the
CPU (the model's own initializer, seeded by the seed and the tensor's name), or only this rank's
slice is read from safetensors; the rank keeps its slice and the full tensor is freed. So the
initial weights do not depend on the layout, the device or the rank: single, ddp, zero1-3, hsdp,
tp, pp and layer-split start bitwise equal, and no rank holds more than one full tensor beyond its
shards (none at all when loading pretrained weights).
"""

from __future__ import annotations

import copy
import hashlib
import sys
from itertools import chain
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshlm.compat import compute_local_shape_and_global_offset, local_tensor, unset_fake_temporarily
from meshlm.errors import MeshlmError
from meshlm.models.families import base_name

if TYPE_CHECKING:
    from meshlm.models.safetensors_read import SafetensorsCheckpoint

WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile


def canonical(name: str) -> str:
    """A tensor's name in the plain transformers model, whatever wraps its modules."""
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in chain(model.parameters(), model.buffers()))


class InitialWeights:
    """The model's own initializer (`_init_weights`, the same distributions as from_config), one tensor at a
    time, on the CPU, with the global generator seeded from (seed, name). `twin` is a meta copy of the
    whole unsplit model taken before parallelizing: it gives each tensor's modules without any storage."""

    def __init__(self, twin: nn.Module, seed: int, special=None):
        self.twin, self.seed, self.special = twin, seed, special

    @classmethod
    def of(cls, model: nn.Module, seed: int, special=None) -> InitialWeights:
        """`special(name, meta_tensor, seed)`: the initial value of tensors the model's initializer does not
        own (LoRA's adapters, parallel/lora.py), or None; those are never read from --pretrained weights."""
        return cls(copy.deepcopy(model), seed, special)

    def owns(self, name: str) -> bool:
        return self.special is not None and self._special(name) is not None

    def _special(self, name: str) -> torch.Tensor | None:
        path, _, attr = name.rpartition(".")
        owner = self.twin.get_submodule(path)
        meta = owner._parameters.get(attr, owner._buffers.get(attr))
        return self.special(name, meta, self.seed) if self.special else None

    def full(self, name: str) -> torch.Tensor:
        value = self._special(name)
        if value is not None:
            return value
        path, _, attr = name.rpartition(".")
        owner = self.twin.get_submodule(path)
        store = owner._parameters if attr in owner._parameters else owner._buffers
        meta = store[attr]
        real = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
        store[attr] = nn.Parameter(real, requires_grad=False) if isinstance(meta, nn.Parameter) else real
        # The owner first, then its ancestors: some reinitialize a child's weight (GPT-2 scales c_proj).
        parts = path.split(".") if path else []
        owners = [self.twin.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]
        digest = hashlib.sha256(f"{self.seed}/{base_name(name)}".encode()).digest()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
                for m in owners:
                    self.twin._init_weights(m)
        finally:
            store[attr] = meta
        return real


def local_index(t: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor this rank holds: a DTensor's local block, or all of a plain tensor."""
    if not isinstance(t, DTensor):
        return tuple(slice(0, n) for n in t.shape)
    with unset_fake_temporarily():  # arithmetic on the mesh's rank table: values, also under fake tensors
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if isinstance(t, DTensor) else t


def named_tensors(model: nn.Module):
    """Every parameter (shared ones once) and buffer, by their names in the plain model."""
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        yield canonical(name), t


def materialize(
    model: nn.Module,
    init: InitialWeights,
    device: torch.device | str,
    pretrained: str | None = None,
    computed_only: bool = False,
):
    """Allocate the tensors still on the meta device on `device` and fill every tensor of `model` with this
    rank's slice: read from the safetensors in `pretrained`, or drawn by `init`. Buffers computed rather than
    loaded (rotary inv_freq) are recomputed by the initializer. Needs no communication.
    computed_only: the caller fills the state dict itself (DCP, infer/load.py); only those buffers are made."""
    ckpt = None
    if pretrained:  # the safetensors reader only for pretrained weights
        from meshlm.models.safetensors_read import SafetensorsCheckpoint

        ckpt = SafetensorsCheckpoint(pretrained)
        ckpt.follow(init.twin)  # transformers' conversions (renames, per-expert -> grouped), read per slice
    left_to_caller = {canonical(n) for n in model.state_dict(keep_vars=True)} if computed_only else set()
    named = list(named_tensors(model))
    keys = check_checkpoint(ckpt, model, [(n, t) for n, t in named if not init.owns(n)], init.twin) if ckpt else {}
    if on_meta(model):
        model.to_empty(device=device)
    # to_empty (here, or layer split's per device) gives each holder of a shared parameter its own copy
    retie(model, shared_parameters(init.twin))
    named = list(named_tensors(model))
    with torch.no_grad():
        for name, t in named:
            index, key = local_index(t), keys.get(name)
            if name in left_to_caller:
                continue
            out = _local(t)
            nf4 = sys.modules.get("meshlm.parallel.nf4")  # loaded by parallelize where it made NF4 weights
            dest = nf4.staging(out) if nf4 else out  # an NF4 weight's slice is read in fp32, then quantised
            if key:
                from meshlm.models.fused import checkpoint_rows  # pretrained weights only

                part = checkpoint_rows(init.twin, base_name(name))  # a fused projection's part: a block of its rows
                if part:
                    index = (slice(index[0].start + part[1], index[0].stop + part[1]), *index[1:])
                _copy_rows(ckpt, key, index, dest)
            else:
                dest.copy_(init.full(name)[index])
            if dest is not out:
                nf4.fill(out, dest, t)


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """Names of the parameters held by more than one module, grouped by parameter."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Make the holders of each shared parameter (GPT-2's embedding and head) that this rank has share it again."""
    held = {
        canonical(n): (m, n.rpartition(".")[2])
        for n, _ in model.named_parameters(remove_duplicate=False)
        for m in [model.get_submodule(n.rpartition(".")[0])]
    }
    for names in ties:
        holders = [held[n] for n in names if n in held]
        for module, attr in holders[1:]:
            module._parameters[attr] = holders[0][0]._parameters[holders[0][1]]


def _copy_rows(ckpt: SafetensorsCheckpoint, key: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
    """Copy the slice `index` of `key` into `out`; rows past the checkpoint's (a vocabulary grown to fit the
    tokenizer) are the mean of its rows, as transformers' resize_token_embeddings makes them (mean resizing)."""
    if not index:  # a scalar parameter (Apertus' xIELU activation)
        out.copy_(ckpt.read(key, ()))
        return
    rows, (start, stop) = ckpt.shape(key)[0], (index[0].start, index[0].stop)
    top = min(stop, rows)
    if top > start:
        ckpt.read_into(key, (slice(start, top), *index[1:]), out[: top - start])
    if stop > rows:
        mean = sum(ckpt.read(key, (slice(a, min(a + 4096, rows)), *index[1:])).sum(0) for a in range(0, rows, 4096))
        out[max(top, start) - start :].copy_((mean / rows).expand(stop - max(top, start), *mean.shape))


def check_checkpoint(ckpt: SafetensorsCheckpoint, model: nn.Module, named, twin: nn.Module | None = None) -> dict:
    """Model tensor name -> checkpoint key, for every parameter and persistent buffer; a one-line error for a
    tensor the checkpoint lacks or whose shape disagrees with the config. `twin`: the unwrapped model, where
    the parts of a fused projection are found (models/fused.py; their key is the fused tensor's)."""
    from meshlm.models.fused import checkpoint_rows  # reading a checkpoint only

    persistent = {canonical(n) for n, _ in model.state_dict(keep_vars=True).items()}
    prefix = getattr(model, "base_model_prefix", "") + "."
    embed = next((n for n, p in named if p is _input_weight(model)), None)
    keys = {}
    for name, t in named:
        if name not in persistent:
            continue
        plain = base_name(name)
        part = checkpoint_rows(twin, plain) if twin is not None else None
        if part:
            plain = part[0]
        aliases = (plain.removeprefix(prefix),)
        if embed and name.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False):
            aliases += (embed, embed.removeprefix(prefix))
        key = ckpt.key(plain, aliases)
        if key is None:
            if not isinstance(t, nn.Parameter):
                continue  # a persistent buffer the checkpoint does not carry keeps its computed value
            raise MeshlmError(f"tensor {name} is missing from the checkpoint in {ckpt.dir}")
        have, want = ckpt.shape(key), tuple(t.shape)
        grown = len(have) == len(want) > 0 and have[1:] == want[1:] and have[0] < want[0] and t is _row_matrix(model, t)
        if part:  # the part's block of the fused tensor's rows must lie inside it
            grown = have[1:] == want[1:] and part[1] + want[0] <= have[0]
        if have != want and not grown:
            raise MeshlmError(
                f"tensor {ckpt.label(key)} in {ckpt.where(key)} has shape {list(have)}, but the model config needs "
                f"{list(want)}"
            )
        keys[name] = key
    return keys


def _input_weight(model: nn.Module):
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(emb, "weight", None)


def _row_matrix(model: nn.Module, t: torch.Tensor):
    """The embedding or LM head weight (one row per token) if `t` is one of them."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for w in (_input_weight(model), getattr(head, "weight", None)):
        if w is t:
            return t
    return None
