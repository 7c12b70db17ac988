"""Reading a checkpoint's tensors whole in the test's own process, to compare runs by their saved weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.safe_load import SafePlanner, SafeReader


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory as full CPU tensors keyed by flattened name, in this process alone."""
    meta = SafeReader(str(path)).read_metadata()
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=True)
    return sd
