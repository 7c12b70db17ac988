"""A checkpoint damaged in place, on 2 real ranks (gloo): 4 KiB zeroed inside the latest checkpoint's shard,
its size unchanged. The rerun finds it against the checksums written at save, says so in one line, resumes
from the checkpoint before it, and trains the same losses as the run that was never damaged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import TINY, assert_close, metrics, run_meshlm

pytestmark = pytest.mark.slow

ARGS = [*TINY, "--nproc", "2", "--strategy", "zero3", "--micro-batch-size", "4", "--ckpt-every", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "run"
    run_meshlm("train", *ARGS, "--max-steps", "4", "--output-dir", out)
    return out


def test_a_shard_damaged_in_place_is_passed_over_for_the_previous_checkpoint(run, tmp_path):
    out = shutil.copytree(run, tmp_path / "run")
    before = {row["step"]: row["loss"] for row in metrics(out)}
    shard = out / "checkpoints" / "step-4" / "state" / "__1_0.distcp"  # rank 1's: rank 1 finds it
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = bytes(4096)
    shard.write_bytes(bytes(data))
    p = run_meshlm("train", *ARGS, "--max-steps", "4", "--output-dir", out)
    damaged = [line for line in p.stdout.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and f"{shard} does not match its checksum" in damaged[0], p.stdout
    assert "resuming from step-2 instead" in damaged[0] and "resumed from" in p.stdout, p.stdout
    after = {row["step"]: row["loss"] for row in metrics(out)}
    assert sorted(after) == [1, 2, 3, 4]
    assert_close([after[3], after[4]], [before[3], before[4]], rtol=1e-6)
    assert (out / "checkpoints" / "step-4" / "MANIFEST.json").is_file()
    assert shard.read_bytes() != bytes(data)  # saved again, whole
