"""A checkpoint's integrity in this process: the manifest written at save covers every file, files and
directories are flushed before `latest` moves, damage in place (same size) is found and the previous complete
checkpoint resumed with one line, and damaged metadata or RNG files are named. The same on 2 real ranks:
tests/test_checkpoint_integrity.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint import integrity
from meshlm.checkpoint.store import MARKER, CheckpointDir, TrainState, read_meta
from meshlm.errors import MeshlmError
from meshlm.models import source
from meshlm.runtime import Runtime


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


@pytest.fixture
def ckpts(tmp_path) -> CheckpointDir:
    """checkpoints/ with complete step-1 and step-2, `latest` naming step-2."""
    model, opt, sched = _parts()
    store = CheckpointDir(tmp_path / "checkpoints", Runtime())
    for step in (1, 2):
        store.save(step, model, opt, sched, TrainState(step=step), {"parameters": 2080}, {"strategy": "single"})
    return store


def _zero_inside(path: Path, n: int = 4096) -> None:
    """n bytes zeroed in the middle of the file (its size unchanged), as a bad disk block would."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - n // 2)
    data[start : start + n] = bytes(min(n, len(data)))
    path.write_bytes(bytes(data))


def _shard(step: Path) -> Path:
    return max((step / "state").glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_the_manifest_names_every_file_with_its_size_and_checksum(ckpts):
    step = ckpts.root / "step-2"
    manifest = json.loads((step / integrity.MANIFEST).read_text())
    files = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()} - {integrity.MANIFEST, MARKER}
    assert set(manifest) == files and {"trainer.json", "rng/rank-0.pt", "state/.metadata"} <= files
    assert manifest["trainer.json"]["bytes"] == (step / "trainer.json").stat().st_size
    assert ckpts.resumable() == step and integrity.damage(step) is None


def test_damage_in_place_falls_back_to_the_previous_checkpoint_in_one_line(ckpts, caplog):
    _zero_inside(_shard(ckpts.root / "step-2"))
    assert integrity.damage(ckpts.root / "step-2", deep=False) is None  # same size: only the checksum sees it
    with caplog.at_level(logging.WARNING, logger="meshlm"):
        assert ckpts.resumable() == ckpts.root / "step-1"
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "does not match its checksum" in lines[0] and "resuming from step-1" in lines[0]
    assert str(_shard(ckpts.root / "step-2")) in lines[0]


def test_damage_with_no_whole_checkpoint_left_is_one_line(ckpts):
    _zero_inside(_shard(ckpts.root / "step-2"))
    _zero_inside(ckpts.root / "step-1" / "rng" / "rank-0.pt", 64)
    with pytest.raises(MeshlmError, match=r"step-2 is damaged \(.*does not match its checksum.*--overwrite$"):
        ckpts.resumable()


@pytest.mark.parametrize(
    "damage",
    [
        lambda step: (step / "trainer.json").write_text("{}"),
        lambda step: (step / "rng" / "rank-0.pt").write_bytes((step / "rng" / "rank-0.pt").read_bytes()[:50]),
        lambda step: (step / "state" / ".metadata").unlink(),
        lambda step: (step / integrity.MANIFEST).write_text("[1, 2]"),
    ],
    ids=["trainer-json-empty", "rng-cut-short", "metadata-missing", "manifest-garbled"],
)
def test_damaged_files_are_named_and_passed_over(ckpts, damage):
    damage(ckpts.root / "step-2")
    assert ckpts.resumable() == ckpts.root / "step-1"
    assert ckpts.resumable(deep=False) == ckpts.root / "step-1"  # the launcher's look agrees


def test_without_a_manifest_damaged_metadata_and_rng_are_still_named(ckpts):
    """A checkpoint written before manifests: trainer.json's fields and the RNG file are checked as they are read."""
    step = ckpts.root / "step-2"
    (step / integrity.MANIFEST).unlink()
    rng = step / "rng" / "rank-0.pt"
    rng.write_bytes(rng.read_bytes()[:50])
    model, opt, sched = _parts()
    with pytest.raises(MeshlmError, match=r"rng/rank-0.pt is corrupt \(.*\); resume from another checkpoint$"):
        ckpts.load(step, model, opt, sched, TrainState())
    (step / "trainer.json").write_text("{}")
    with pytest.raises(MeshlmError, match=r"step-2/trainer.json lacks .state., .scheduler., .fingerprint."):
        read_meta(step)
    assert ckpts.resumable() == ckpts.root / "step-1"


def test_export_and_generate_refuse_a_damaged_checkpoint(ckpts):
    _zero_inside(_shard(ckpts.root / "step-2"))
    with pytest.raises(MeshlmError, match=r"step-2 is damaged \(.*does not match its checksum.*\); use an older"):
        source.find_checkpoint(ckpts.root.parent)
    assert source.find_checkpoint(ckpts.root / "step-1")[0] == ckpts.root / "step-1"


def test_every_file_and_directory_is_flushed_before_latest_moves(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    model, opt, sched = _parts()
    CheckpointDir(tmp_path, Runtime()).save(3, model, opt, sched, TrainState(step=3), {}, {})
    monkeypatch.setattr(os, "fsync", real_fsync)
    moved = events.index(("replace", str(tmp_path / "latest")))
    synced = {path for kind, path in events[:moved] if kind == "fsync"}
    tmp = str(tmp_path / ".tmp-step-3")
    step = tmp_path / "step-3"
    files = {str(p).replace(str(step), tmp) for p in step.rglob("*")}  # the files and directories, before the rename
    assert files | {tmp, str(tmp_path), str(tmp_path / ".latest.tmp")} <= synced, files - synced
    assert events[moved + 1 :] == [("fsync", str(tmp_path))]  # the pointer's rename itself


def test_an_interrupted_copy_is_found_by_size_before_any_rank_starts(ckpts, tmp_path):
    """A checkpoint copied elsewhere and cut short: the launcher's look (sizes only) already passes it over."""
    copy = shutil.copytree(ckpts.root, tmp_path / "copy")
    shard = _shard(copy / "step-2")
    shard.write_bytes(shard.read_bytes()[:100])
    assert f"{shard} has 100 bytes, the save wrote " in integrity.damage(copy / "step-2", deep=False)
    assert CheckpointDir(copy, Runtime()).resumable(deep=False) == copy / "step-1"
