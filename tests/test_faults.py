"""Faults: elastic restarts resume bitwise, crash-safe checkpoints, a full disk, hangs, a rank's exception,
non-finite losses, and checkpoint loading that runs no code. The testing aids are in meshlm/train/faults.py."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import TINY, metrics, run_meshlm, tree_digest
from helpers.checkpoints import read_tensors
from meshlm import cli
from meshlm.checkpoint import safe_load
from meshlm.checkpoint.store import MARKER
from meshlm.launch_failures import stuck_at

pytestmark = pytest.mark.slow  # in-process checkpoint checks: tests/unit/test_checkpoint.py

TWO_RANKS = ["--nproc", "2", *TINY, "--micro-batch-size", "2"]


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {what}:\n{proc.communicate()[0][-3000:]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _log_has(path: Path, text: str):
    return lambda: path.is_file() and text in path.read_text(errors="replace")


def _stalled_pid(log: Path) -> int:
    """The pid of the rank that logged that it stalls (train/faults.py)."""
    return int(re.search(r"\(pid (\d+)\) stalls at step", log.read_text(errors="replace")).group(1))


def _popen(*args, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "meshlm", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def test_elastic_restarts_resume_bitwise(tmp_path):
    """Rank 1 is SIGKILLed inside step 12 (held there by the stall aid), then raises inside step 17 after the
    first restart; torchrun restarts all ranks twice, each time resuming from checkpoints/latest (every 5
    steps). After 30 steps every parameter and optimizer state equals the uninterrupted run's, bit for bit
    (CPU, fp32)."""
    args = [*TWO_RANKS, "--max-steps", "30", "--ckpt-every", "5", "--log-every", "1"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    uninterrupted = _popen("train", *args, "--output-dir", ref)  # alongside: the faulted run waits a lot
    proc = _popen(
        "train",
        *args,
        "--max-restarts",
        "2",
        "--output-dir",
        run,
        env={
            "MESHLM_STALL_AT_STEP": "12",
            "MESHLM_STALL_RANK": "1",
            "MESHLM_FAIL_AT_STEP": "17@1",
            "MESHLM_FAIL_RANK": "1",
        },
    )
    _wait_for(_log_has(run / "logs" / "rank-1.log", "stalls at step 12"), proc, "rank 1 to reach step 12")
    os.kill(_stalled_pid(run / "logs" / "rank-1.log"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert len(re.findall(r"restarting all ranks from checkpoints/latest", out)) == 2, out
    assert "Traceback" not in out

    ref_out, _ = uninterrupted.communicate(timeout=600)
    assert uninterrupted.returncode == 0, ref_out[-4000:]
    got, want = (read_tensors(d / "checkpoints" / "step-30" / "state") for d in (run, ref))
    assert got.keys() == want.keys() and any(k.startswith("optim.") for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    steps = [row["step"] for row in metrics(run)]
    assert steps == list(range(1, 31))  # the rows each restart replayed (from 10, then 15) replaced, not repeated
    assert [row["loss"] for row in metrics(run) if row["step"] == 30] == [metrics(ref)[-1]["loss"]]


def test_a_hang_becomes_a_failure_that_names_the_stuck_rank(tmp_path):
    """Rank 1 stalls in step 3; rank 0's next collective times out after --dist-timeout. The job fails
    (exit 1) instead of hanging; the console shows rank 0's error once and names where rank 1 was stuck;
    both ranks' logs hold their stacks."""
    out = tmp_path / "out"
    p = run_meshlm(
        "train",
        *TWO_RANKS,
        "--max-steps",
        "6",
        "--dist-timeout",
        "5",
        "--output-dir",
        out,
        env={"MESHLM_STALL_AT_STEP": "3", "MESHLM_STALL_RANK": "1"},
        check=False,
    )
    assert p.returncode == 1, p.stderr
    assert re.search(r"meshlm: rank 0 failed \(exit code 1\): .*Timed out", p.stderr), p.stderr
    assert re.search(
        r"meshlm: rank 1 was stuck in in_step \(faults\.py:\d+\) "
        r"called from train_step \(trainer\.py:\d+\) at step 3;",
        p.stderr,
    ), p.stderr
    assert p.stderr.count("Traceback") == 1
    assert "Current thread" in (out / "logs" / "rank-1.log").read_text()  # faulthandler's dump
    assert "Timed out" in (out / "logs" / "rank-0.log").read_text()  # the exception, in the rank's own log


def _stall_then(sig: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Rank 1 held inside step 3 (the stall aid; rank 0 waits for it in a collective), then sent `sig`."""
    proc = _popen(
        "train",
        *TWO_RANKS,
        "--max-steps",
        "6",
        "--output-dir",
        out,
        *extra,
        env={"MESHLM_STALL_AT_STEP": "3", "MESHLM_STALL_RANK": "1"},
    )
    _wait_for(_log_has(out / "logs" / "rank-1.log", "stalls at step 3"), proc, "rank 1 to reach step 3")
    os.kill(_stalled_pid(out / "logs" / "rank-1.log"), sig)
    text, _ = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, text)


def test_a_killed_rank_is_named_with_its_exit_code(tmp_path):
    """kill -9 of rank 1 while rank 0 waits for it: rank 0's "connection closed by peer" (which may reach its
    error file before the launcher sees rank 1 gone) must not hide the rank that was killed."""
    p = _stall_then(signal.SIGKILL, tmp_path / "out")
    assert p.returncode == 1, p.stdout[-3000:]
    assert "meshlm: rank 1 failed (exit code -9): killed by SIGKILL" in p.stdout, p.stdout[-3000:]


def test_a_frozen_rank_is_named_with_its_last_step(tmp_path):
    """kill -STOP of rank 1: rank 0 times out after --dist-timeout (no hang), and the console names rank 1 and
    the step it was in, not only rank 0's timeout."""
    p = _stall_then(signal.SIGSTOP, tmp_path / "out", "--dist-timeout", "10")
    assert p.returncode == 1, p.stdout[-3000:]
    assert re.search(r"meshlm: rank 0 failed \(exit code 1\): .*Timed out", p.stdout), p.stdout[-3000:]
    assert "meshlm: rank 1 stopped answering at step 3: it left no stack dump" in p.stdout, p.stdout[-3000:]


def test_stuck_at_reads_the_main_thread_of_a_fatal_signal_dump():
    """What NCCL's watchdog abort leaves in a rank's log (faulthandler on SIGABRT): the main thread is found
    among the others, and the report names the innermost frame and meshlm's code that called it."""
    dump = """2026-01-01 00:00:00,000 [rank 3] INFO saved step-10
Fatal Python error: Aborted

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/src/meshlm/parallel/engine.py", line 95 in mean_over_dp
  File "/src/meshlm/train/trainer.py", line 176 in _loop
  File "/src/meshlm/__main__.py", line 4 in <module>

Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)
"""
    assert stuck_at(dump) == "all_reduce (distributed_c10d.py:3252) called from mean_over_dp (engine.py:95)"
    assert stuck_at(dump + "2026-01-01 00:00:09,000 [rank 3] INFO resumed from step-10\n") is None


def test_a_rank_exception_is_shown_once(tmp_path):
    out = tmp_path / "out"
    p = run_meshlm(
        "train",
        *TWO_RANKS,
        "--max-steps",
        "4",
        "--output-dir",
        out,
        env={"MESHLM_FAIL_AT_STEP": "2", "MESHLM_FAIL_RANK": "1"},
        check=False,
    )
    assert p.returncode == 1
    assert "meshlm: rank 1 failed (exit code 1): RuntimeError: injected fault at step 2 on rank 1" in p.stderr
    assert p.stderr.count("Traceback") == 1 and "was stuck" not in p.stderr and "Traceback" not in p.stdout
    logs = out / "logs"
    paths = f"error file {logs / 'rank-1.error.json'}, stderr {logs / 'rank-1.stderr'}, log {logs / 'rank-1.log'}"
    assert f"meshlm: rank 1: {paths}" in p.stderr, p.stderr
    assert (logs / "rank-1.error.json").is_file() and (logs / "rank-1.log").is_file()
    noise = [ln for ln in p.stderr.splitlines() if not ln.startswith(("meshlm: ", "Traceback", "  ", "RuntimeError"))]
    assert not noise, noise  # nothing from rank 0 or from torchelastic's own logging


@pytest.fixture
def in_process(monkeypatch):
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield monkeypatch
    torch.use_deterministic_algorithms(deterministic)


def _train(*args) -> int:
    """`meshlm train TINY ARGS` in this process (no interpreter start-up); returns the exit status."""
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *TINY, "--micro-batch-size", "4", *map(str, args)])
    return e.value.code


def test_checkpoints_survive_a_kill_during_save_and_a_full_disk(tmp_path, in_process, capsys):
    """(1) SIGKILL while the save of step 10 is paused between the shards and the COMPLETE marker: `latest`
    still names step 5, which loads. (2) The next run warns about and removes the half-written step (and a
    stray step directory without marker), resumes from step 5, and with --keep-last 1 keeps only the newest.
    (3) A file-size limit (as a full disk would) makes the save of step 20 fail: one line naming the path,
    exit 2, and the previous checkpoint untouched. (2) and (3) run in this process."""
    out = tmp_path / "out"
    ckpts = out / "checkpoints"
    args = ["--ckpt-every", "5", "--output-dir", out]
    proc = _popen(
        "train", *TINY, "--micro-batch-size", "4", *args, "--max-steps", "10", env={"MESHLM_PAUSE_IN_SAVE": "10"}
    )
    _wait_for(_log_has(out / "logs" / "rank-0.log", "pausing inside the save of step 10"), proc, "the save")
    proc.kill()
    proc.wait()
    assert (ckpts / "latest").read_text().strip() == "step-5"
    assert (ckpts / ".tmp-step-10" / "state" / ".metadata").is_file() and not (ckpts / ".tmp-step-10" / MARKER).exists()
    assert all(t.isfinite().all() for t in read_tensors(ckpts / "step-5" / "state").values())
    (ckpts / "step-7" / "state").mkdir(parents=True)  # a step directory without marker (copied half, say)

    capsys.readouterr()
    assert _train(*args, "--max-steps", "15", "--keep-last", "1") == 0
    logged = capsys.readouterr().out
    assert re.search(r"removing .*\.tmp-step-10: an interrupted save", logged), logged
    assert re.search(r"removing .*step-7: an interrupted save", logged)
    assert re.search(r"resumed from .*step-5 at step 5", logged)
    assert sorted(x.name for x in ckpts.iterdir()) == ["latest", "step-15"]

    before = tree_digest(ckpts)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))  # writes past 256 KiB fail with EFBIG
    try:  # (Python ignores SIGXFSZ), as they would on a full disk
        status = _train(*args, "--max-steps", "20")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    written = r"meshlm: error: could not write checkpoint \S*/\.tmp-step-20\S*: File too large"
    assert re.match(written, lines[0]), lines[0]
    assert tree_digest(ckpts) == before  # step-15 and latest untouched, the half-written step-20 removed


def test_nonfinite_loss_stops_or_is_skipped(tmp_path, in_process, capsys):
    """NaN loss and gradients at step 3: by default one line naming the step and exit 2, before any update or
    checkpoint holds them; with --skip-nonfinite 1 the update is skipped (weights and optimizer state after
    step 3 equal those after step 2) and training goes on."""
    in_process.setenv("MESHLM_NONFINITE_STEPS", "3")
    stop, skip = tmp_path / "stop", tmp_path / "skip"
    capsys.readouterr()
    assert _train("--max-steps", "5", "--ckpt-every", "1", "--output-dir", stop) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm: error: loss or gradients are not finite at step 3 ") and "\n" not in err, err
    assert sorted(p.name for p in (stop / "checkpoints").glob("step-*")) == ["step-1", "step-2"]

    assert _train("--max-steps", "5", "--ckpt-every", "1", "--skip-nonfinite", "1", "--output-dir", skip) == 0
    assert (
        "step 3: loss or gradients are not finite; skipped the update (1 of --skip-nonfinite 1)"
        in capsys.readouterr().out
    )
    state = {s: read_tensors(skip / "checkpoints" / f"step-{s}" / "state") for s in (2, 3, 5)}
    for k, v in state[3].items():  # parameters, AdamW moments and step counters: all as after step 2
        assert v.isfinite().all() and torch.equal(v, state[2][k]), k
    assert not torch.equal(state[5]["model.lm_head.weight"], state[3]["model.lm_head.weight"])
    assert [r["step"] for r in metrics(skip)] == [1, 2, 4, 5]


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_objects_are_never_unpickled(tmp_path):
    """A non-tensor item whose pickle would run code: DCP's default planner would run it on load
    (torch.load(weights_only=False)); meshlm's loader refuses it."""
    path = tmp_path / "state"
    dcp.save({"w": torch.ones(3), "obj": _Payload(tmp_path / "pwned")}, checkpoint_id=str(path), no_dist=True)
    target = {"w": torch.zeros(3), "obj": None}
    with pytest.raises(BaseException, match="Unsupported global|weights_only"):
        safe_load.load(target, path)
    assert not (tmp_path / "pwned").exists()
    dcp.load(target, checkpoint_id=str(path), no_dist=True)  # the unsafe default, for contrast
    assert (tmp_path / "pwned").exists()
