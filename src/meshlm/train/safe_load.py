"""Read DCP checkpoints without unpickling arbitrary objects.

A checkpoint directory may come from somewhere else (a colleague, a download), so
loading it must not run code. DCP reads tensor data with torch.load(weights_only=True)
already, but two places use full pickle: FileSystemReader.read_metadata unpickles the
`.metadata` file with pickle.load, and DefaultLoadPlanner.load_bytes reads non-tensor
items (optimizer hyper-parameters) with torch.load(weights_only=False). Here the
metadata goes through an unpickler that only builds DCP's own metadata classes, and
non-tensor items through torch.load(weights_only=True).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint._nested_dict import set_element

from meshlm.errors import MeshlmError

_DCP_METADATA = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex")
ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and plain data; anything else (os.system, eval, ...) is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def check_metadata(path: Path) -> None:
    """Refuse, with one line, a DCP directory whose metadata holds anything but plain data."""
    try:
        SafeReader(str(path)).read_metadata()
    except pickle.UnpicklingError as e:
        raise MeshlmError(f"{path / '.metadata'} is refused: {e}; it was not written by meshlm or DCP, "
                          f"or was tampered with") from None


def load(state_dict: dict, path: Path) -> None:
    """dcp.load into `state_dict` (in place, any layout) from the DCP directory `path`."""
    check_metadata(path)  # DCP would bury the refusal under its fallbacks
    dcp.load(state_dict, storage_reader=SafeReader(str(path)), planner=SafePlanner())


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory as full CPU tensors keyed by flattened name, in this process alone."""
    meta = SafeReader(str(path)).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=True)
    return sd
