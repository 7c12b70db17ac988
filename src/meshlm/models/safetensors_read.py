"""Read a pretrained checkpoint one slice at a time, straight from its safetensors files.

A rank reads only the rows and columns its layout gives it (`safe_open(...).get_slice`, via files.py): a TP
column or row shard, the tensors of its pipeline stages, an FSDP dim-0 shard. The files are
memory-mapped, so nothing beyond the slice is ever copied. Works for one `model.safetensors` and
for sharded checkpoints (`model.safetensors.index.json`). A checkpoint whose tensors transformers converts
on load (renamed, per-expert tensors grouped, fused or split ones) is read through the same conversion,
slice by slice (models/conversions.py, after `follow(model)`). Pickle (`.bin`) checkpoints cannot be
sliced without reading them whole: they are refused with the one line that converts them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from meshlm import files
from meshlm.errors import MeshlmError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
BLOCK_BYTES = 16 * 2**20  # how much of a tensor `read_into` maps at a time


class SafetensorsCheckpoint:
    """Tensor name -> file of a local checkpoint directory, checked when opened (files exist)."""

    def __init__(self, name: str | Path):
        self.dir = Path(name) if Path(name).is_dir() else _download(str(name))
        if (self.dir / INDEX).is_file():
            weight_map = files.read_json(self.dir / INDEX, need=("weight_map",))["weight_map"]
        elif (self.dir / SINGLE).is_file():
            weight_map = dict.fromkeys(_keys(self.dir / SINGLE), SINGLE)
        else:
            bins = sorted(p.name for p in self.dir.glob("*.bin"))
            how = (
                f'; it has {bins[0]}: convert it with `python -c "from transformers import '
                f"AutoModelForCausalLM as M; M.from_pretrained('{self.dir}').save_pretrained('{self.dir}')\"`"
                if bins
                else ""
            )
            raise MeshlmError(
                f"--pretrained reads safetensors weights, and {self.dir} has neither {SINGLE} nor {INDEX}{how}"
            )
        for name, file in weight_map.items():
            if not (self.dir / file).is_file():
                raise MeshlmError(f"{self.dir / INDEX} names {file} for tensor {name}, but that file is missing")
        for file in set(weight_map.values()):
            with files.safetensors(self.dir / file):  # its header against its size: a file cut short is found here
                pass
        self.weight_map = weight_map
        self.sources: dict = {}  # model name -> tree over the stored tensors (models/conversions.py)

    def follow(self, model) -> None:
        """Read through transformers' checkpoint conversion for `model` (a PreTrainedModel, on meta): model names
        then resolve to their converted sources."""
        from meshlm.models.conversions import model_sources

        self.sources = model_sources(model, self)

    def key(self, name: str, aliases: tuple[str, ...] = ()):
        """The checkpoint's key for a model tensor name (or one of its aliases), a converted source, or None."""
        for k in (name, *aliases):
            if k in self.sources:
                return self.sources[k]
        return next((k for k in (name, *aliases) if k in self.weight_map), None)

    def label(self, key) -> str:
        """How an error names a key: the stored name, or a converted tensor's first source and count."""
        if isinstance(key, str):
            return key
        names = key.keys()
        return f"{names[0]} (and {len(names) - 1} more, converted)" if len(names) > 1 else names[0]

    def shape(self, key) -> tuple[int, ...]:
        if not isinstance(key, str):
            return tuple(key.shape)
        with files.safetensors(self.where(key)) as f:
            return tuple(f.get_slice(key).get_shape())

    def read(self, key, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice `index` of tensor `key`, as float32 on the CPU. The file is mapped for this read only, and
        a float32 slice is a view of the mapping: the pages it touches (a column slice: all of its rows') count
        in the process's resident memory until the returned tensor is freed."""
        if not isinstance(key, str):
            return key.read(index)
        with files.safetensors(self.where(key)) as f:
            return f.get_slice(key)[index].to(torch.float32)

    def read_into(self, key: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy the slice `index` of tensor `key` into `out`, about BLOCK_BYTES of rows at a time, each block's
        mapping freed before the next: reading a whole 125 MiB embedding at once held it twice (its mapped
        pages and `out`), which was the peak of a pipeline stage that holds it."""
        if not isinstance(key, str):  # a converted tensor: its parts are read one stored slice at a time
            out.copy_(key.read(index))
            return
        row_bytes = 4 * math.prod(self.shape(key)[1:])  # what a row of the file maps, or of its float32 cast
        step = max(1, BLOCK_BYTES // max(1, row_bytes))
        start, stop = index[0].start, index[0].stop
        for a in range(start, stop, step):
            b = min(a + step, stop)
            out[a - start : b - start].copy_(self.read(key, (slice(a, b), *index[1:])))

    def where(self, key) -> Path:
        return self.dir / self.weight_map[key if isinstance(key, str) else key.keys()[0]]


def _keys(path: Path) -> list[str]:
    with files.safetensors(path) as f:
        return list(f.keys())


def _download(repo_id: str) -> Path:
    """A hub id: its safetensors and config files in the local Hugging Face cache (fetched once)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.safetensors", "*.json"]))
    except Exception as e:  # offline, unknown repo, no access: all say the same thing to the user
        raise MeshlmError(f"could not fetch the weights of {repo_id!r}: {str(e).splitlines()[0]}") from None
