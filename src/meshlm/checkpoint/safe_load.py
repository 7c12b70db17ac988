"""Read meshlm's DCP checkpoints without unpickling arbitrary objects.

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
import re
import warnings
import zipfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    FileSystemReader,
)
from torch.distributed.checkpoint.metadata import StorageMeta

from meshlm.compat import set_element
from meshlm.errors import MeshlmError

_DCP_METADATA = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
    "StorageMeta",
    "MetadataIndex",
)
ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
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
        raise MeshlmError(
            f"{path / '.metadata'} is refused: {e}; it was not written by meshlm or DCP, or was tampered with"
        ) from None


def load(state_dict: dict, path: Path, no_dist: bool = False) -> None:
    """dcp.load into `state_dict` (in place, any layout) from the DCP directory `path`; with no_dist, in
    this process alone (export, `generate --checkpoint`), whatever layout wrote it."""
    check_metadata(path)  # DCP would bury the refusal under its fallbacks
    dcp.load(state_dict, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=no_dist)


def load_step(state_dict: dict, step_dir: Path) -> None:
    """Read a checkpoint's state into `state_dict` in this process alone (export, `generate --checkpoint`):
    one line, exit 2, only when the checkpoint itself is unreadable; anything else keeps its traceback."""
    try:
        with warnings.catch_warnings():  # "loading in a single process": that is the point
            warnings.filterwarnings("ignore", message=".*single process.*")
            load(state_dict, step_dir / "state", no_dist=True)  # no_dist: also inside a job
    except MeshlmError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps a missing shard file in this BaseException
        reason = unreadable(step_dir / "state", e)
        if reason is None:
            raise  # not the checkpoint's fault (out of memory, a bug): its traceback says what
        raise MeshlmError(f"checkpoint {step_dir} cannot be loaded (corrupt or missing shards): {reason}") from None


def error_chain(e: BaseException):
    """`e`, its causes and contexts, and what a CheckpointException wraps (every rank's failure)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        if isinstance(x, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in x.failures.values()]


# What reading damaged bytes raises: a cut pickle, a broken zip (torch.save's container), bad magic.
DAMAGE = re.compile(
    r"PytorchStreamReader|central directory|invalid magic number|unexpected EOF|"
    r"storage has wrong byte size|truncated",
    re.IGNORECASE,
)


def unreadable(path: Path, e: BaseException) -> str | None:
    """Why the DCP directory `path` cannot be read, when that is why loading it raised `e`; None when the
    files are all there and whole (then `e` is something else: out of memory, a lost peer, a bug).

    The files are checked first (metadata, every shard it names, long enough for every item), then
    the error itself for what reading damaged bytes raises.
    """
    try:
        meta = SafeReader(str(path)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as m:
        return f"{path / '.metadata'} cannot be read ({type(m).__name__}: {m})"
    for info in meta.storage_data.values():
        shard = path / info.relative_path
        if not shard.is_file():
            return f"shard file {shard} is missing"
        if shard.stat().st_size < info.offset + info.length:
            return f"shard file {shard} is truncated ({shard.stat().st_size} bytes, needs {info.offset + info.length})"
    for x in error_chain(e):
        if isinstance(x, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile)) or DAMAGE.search(str(x)):
            return f"damaged data ({type(x).__name__}: {str(x).strip().splitlines()[-1] if str(x).strip() else ''})"
    return None
