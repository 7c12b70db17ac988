"""Meta-device build and name-seeded init: every layout starts from bitwise-equal weights.

Each layout builds the model on the meta device, parallelizes it there and then fills only this
rank's part, drawing every tensor from (seed, name) with the model's own initializer. One step at
--lr 1e-30 then saves a checkpoint: an update of ~1e-29 does not change an fp32 weight of TINY's
magnitudes (none is zero), so the checkpoint holds the initial weights, gathered by name by torch's
own DCP converter, and they must be equal to the last bit across layouts.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import TINY, run_cases

pytestmark = pytest.mark.slow

ARGS = [
    *TINY,
    "--builtin-samples",
    "64",
    "--seq-length",
    "32",
    "--max-steps",
    "1",
    "--lr",
    "1e-30",
    "--warmup-steps",
    "0",
    "--micro-batch-size",
    "4",
]
LAYOUTS = {
    "single": (1, []),
    "ddp-2": (2, ["--strategy", "ddp", "--micro-batch-size", "2"]),
    "zero3-2": (2, ["--strategy", "zero3", "--micro-batch-size", "2"]),
    "hsdp-2x2": (4, ["--strategy", "hsdp", "--parallel.shard-size", "2", "--micro-batch-size", "1"]),
    "tp-2": (2, ["--parallel.tp", "2"]),
    "pp-2": (2, ["--parallel.pp", "2", "--parallel.micro-batches", "2"]),
    "layer-split": (1, ["--strategy", "layer-split", "--devices", "cpu,cpu"]),
}


def initial_weights(out, tmp_path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(out / "checkpoints" / "step-1" / "state", tmp_path / "full.pt")
    return torch.load(tmp_path / "full.pt", weights_only=False)["model"]


def test_initial_weights_equal_in_every_layout(tmp_path):
    """The layouts of one world size run in one launch, one after another (conftest.run_cases)."""
    for world in sorted({nproc for nproc, _ in LAYOUTS.values()}):
        cases = [
            {"id": name, "kind": "train", "args": [*ARGS, *layout, "--output-dir", str(tmp_path / name)]}
            for name, (nproc, layout) in LAYOUTS.items()
            if nproc == world
        ]
        run_cases(world, cases, tmp_path / "launches")
    weights = {name: initial_weights(tmp_path / name, tmp_path / name) for name in LAYOUTS}
    ref = weights["single"]
    assert len(ref) >= 10 and all(t.abs().min() > 0 for t in ref.values())  # no zero the tiny step could move
    for name, w in weights.items():
        assert w.keys() == ref.keys(), name
        for fqn, t in w.items():
            assert torch.equal(t, ref[fqn]), f"{name}: {fqn} differs from single"
