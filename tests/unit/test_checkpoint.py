"""Checkpoints in this process: what counts as a failed write and the one line every rank raises for it,
retention (--keep-last) around `latest`, an atomic save and its load, and the cadence training saves at.
Kills during a save, a full disk and multi-rank agreement run for real in tests/test_faults.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from conftest import TINY
from meshlm import cli, config, files, options
from meshlm.checkpoint import run_dir, store
from meshlm.checkpoint.saving import SaveAndResume
from meshlm.checkpoint.store import MARKER, CheckpointDir, TrainState, _write_failure
from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.layout import Layout
from meshlm.runtime import Runtime, agree_on_error


def test_what_counts_as_a_failed_write(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/x.distcp")
    assert _write_failure(full, tmp_path) == "/ckpt/x.distcp: No space left on device"
    wrapped = RuntimeError("wrapped")
    wrapped.__context__ = full
    assert _write_failure(wrapped, tmp_path) == "/ckpt/x.distcp: No space left on device"
    assert _write_failure(CheckpointException("save", {0: full}), tmp_path).endswith("No space left on device")
    assert "cut short" in _write_failure(RuntimeError("unexpected pos 123"), tmp_path)
    assert _write_failure(RuntimeError("a bug, not the disk"), tmp_path) is None


def test_failure_agreement_in_one_process():
    agree_on_error(None)  # nobody failed: nothing raised
    with pytest.raises(MeshlmError, match="^could not write x$"):
        agree_on_error("could not write x")


def test_a_failed_part_of_the_save_is_removed_and_said_in_one_line(tmp_path):
    ckpt = CheckpointDir(tmp_path, Runtime())
    tmp = tmp_path / ".tmp-step-3"

    def fail():
        (tmp / "rng").mkdir(parents=True)
        raise OSError(errno.EFBIG, "File too large", str(tmp / "rng" / "rank-0.pt"))

    with pytest.raises(MeshlmError, match=r"could not write checkpoint .*rank-0.pt: File too large; free space"):
        ckpt._write(tmp, fail)
    assert not tmp.exists()
    with pytest.raises(ZeroDivisionError):  # anything else is a bug and stays a traceback
        ckpt._write(tmp, lambda: 1 / 0)


def test_keep_last_never_deletes_what_latest_names(tmp_path):
    for step in (1, 2, 3, 4):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / MARKER).write_text("")
    (tmp_path / "latest").write_text("step-2\n")  # e.g. resumed from an older checkpoint
    CheckpointDir(tmp_path, Runtime(), keep_last=1).retain()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-4"]


def test_save_publishes_atomically_and_loads_back(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = CheckpointDir(tmp_path, Runtime(), keep_last=1)
    for step in (1, 2):
        path = ckpt.save(step, model, opt, sched, TrainState(step=step), {"parameters": 15}, {"strategy": "single"})
    assert ckpt.latest() == path == tmp_path / "step-2" and (path / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2"]  # keep-last 1, no .tmp left
    assert ckpt.check_model(path, {"parameters": 15})["state"]["step"] == 2
    with pytest.raises(MeshlmError, match="is from another model"):
        ckpt.check_model(path, {"parameters": 16})

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state = TrainState()
    ckpt.load(path, fresh, fresh_opt, torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0), state)
    assert state.step == 2 and torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize(
    "every, save_final, want", [(0, True, [6]), (2, True, [2, 4, 6]), (4, False, [4]), (0, False, [])]
)
def test_cadence(tmp_path, every, save_final, want):
    cfg = Config(output_dir=str(tmp_path), max_steps=6, ckpt_every=every, save_final=save_final)
    checkpoints = SaveAndResume(cfg, Runtime(), {}, Layout("single"), {})
    assert [s for s in range(1, 7) if checkpoints.due(s)] == want


def _train_here(*args: str) -> None:
    """`meshlm train ARGS` as the only rank, in this process (it must succeed)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *args])
    torch.use_deterministic_algorithms(deterministic)
    assert e.value.code == 0


def test_a_resume_reads_trainer_json_once_per_process(tmp_path, monkeypatch):
    """The launcher's checks (a finished run?, the directory, the global batch kept) and a rank's (the directory,
    continuity, the checkpoint to resume from, its model, its load) all look at the checkpoint's trainer.json:
    each process parses it once."""
    args = [*TINY, "--builtin-samples", "40", "--output-dir", str(tmp_path / "run")]
    _train_here(*args, "--max-steps", "1")
    reads = []
    read_json = files.read_json

    def counted(path, *a, **kw):
        reads.extend([path] if Path(path).name == "trainer.json" else [])
        return read_json(path, *a, **kw)

    monkeypatch.setattr(files, "read_json", counted)
    cfg = config.load(None, config.parse_args([*args, "--max-steps", "2"]))
    assert run_dir.finished(cfg) is None  # the launcher, as cli's train command runs it before the ranks start
    options.check_job(cfg, 1, data=True)
    assert len(reads) == 1
    monkeypatch.setattr(store, "_META_READ", {})  # a rank: a process of its own, nothing read yet
    _train_here(*args, "--max-steps", "2")
    assert reads == [tmp_path / "run" / "checkpoints" / "step-1" / "trainer.json"] * 2
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()
