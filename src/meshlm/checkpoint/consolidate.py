"""Consolidate a checkpoint of any layout into sharded safetensors, one tensor at a time.

DCP reassembles each tensor from every rank's shards; only that tensor and the output shard being
filled are in memory (peak about one tensor plus `max_shard_bytes`), never the model. The model is
only its meta-device skeleton: names, shapes, the config and which weights are tied. A tied LM
head (GPT-2) is stored once, as transformers stores it, so the export loads with the tie kept. Tensors
transformers converts on load are written as its save_pretrained writes them (its conversion reverted:
a Mixtral's grouped experts as block_sparse_moe.experts.N.w1/w2/w3), a group of tensors at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from meshlm.checkpoint import safe_load
from meshlm.models.families import tied
from meshlm.models.fused import fused_tensors

SHARD_BYTES = 2 * 1024**3


def tensors_to_write(model: nn.Module) -> list[str]:
    """State dict names, a tied head's weight left out (it is the embedding's)."""
    head, head_tied = model.get_output_embeddings(), tied(model)
    skip = {n for n, p in model.named_parameters(remove_duplicate=False) if head_tied and p is head.weight}
    first = next(n for n, p in model.named_parameters() if head_tied and p is head.weight) if head_tied else None
    return [n for n in model.state_dict(keep_vars=True) if n not in skip or n == first]


def _read(step_dir: Path, name: str, like: torch.Tensor) -> torch.Tensor:
    t = torch.empty(like.shape, dtype=like.dtype)
    safe_load.load_step({"model": {name: t}}, step_dir)  # the restricted unpickler; 'corrupt' only when it is
    return t


def _read_parts(step_dir: Path, names: list[str], state: dict) -> torch.Tensor:
    if len(names) == 1:
        return _read(step_dir, names[0], state[names[0]])
    return torch.cat([_read(step_dir, n, state[n]) for n in names])


def write_safetensors(model: nn.Module, step_dir: Path, out: Path, max_shard_bytes: int = SHARD_BYTES) -> None:
    """`model` on the meta device; its weights from the DCP checkpoint in `step_dir`, written into `out` as
    model.safetensors, or model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    from meshlm.models.conversions import saved_groups, saved_names

    names, shards, shard, size = tensors_to_write(model), [], {}, 0
    state = model.state_dict(keep_vars=True)
    # a fused projection held as parts (models/fused.py) is one tensor again, then saved as transformers saves it
    parts = fused_tensors(model, names)
    for group in saved_groups(model, list(parts)):
        whole = {n: _read_parts(step_dir, parts[n], state) for n in group}
        for name, t in saved_names(model, whole).items():
            if shard and size + t.nbytes > max_shard_bytes:
                shards.append(_flush(shard, out, len(shards)))
                shard, size = {}, 0
            shard[name], size = t, size + t.nbytes
    shards.append(_flush(shard, out, len(shards)))
    if len(shards) == 1:
        (out / shards[0][0]).rename(out / "model.safetensors")
        return
    final = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for (tmp_name, keys), name in zip(shards, final):
        (out / tmp_name).rename(out / name)
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(state[n].numel() * state[n].element_size() for n in names)  # the parts add up to the whole
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def _flush(shard: dict, out: Path, i: int) -> tuple[str, list[str]]:
    name = f"part-{i}.safetensors"
    save_file({k: v.contiguous() for k, v in shard.items()}, str(out / name), metadata={"format": "pt"})
    return name, list(shard)
