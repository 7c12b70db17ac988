"""A user's first week with one run directory, as they would type it: Ctrl-C, a second job, a killed launcher,
`--resume false`, a rerun on another rank count, a finished run rerun; a step with nothing to learn; and a
rerun on a changed dataset.

One run of 40 steps lives through all of it (the steps are cheap, the launches are what costs), and at the end
its metrics.jsonl holds each step exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY, metrics, run_meshlm, tree_digest
from meshlm import cli

pytestmark = pytest.mark.slow

STEPS = 60
# Checkpoints only at the end or on a signal (saved whatever the age of the last one): where an interrupted
# run stopped is then exactly where the next one resumes.
RUN = [
    *TINY,
    "--micro-batch-size",
    "2",
    "--max-steps",
    str(STEPS),
    "--ckpt-on-signal-after",
    "0.001",
    "--eval-every",
    "20",
    "--eval-fraction",
    "0.05",
]


_jobs: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    yield
    while _jobs:  # a failed test leaves no launcher behind (its ranks die with it)
        job = _jobs.pop()
        if job.poll() is None:
            job.kill()
            job.communicate()


def _start(out: Path, *args: str, step_s: float = 0.3) -> subprocess.Popen:
    """`meshlm train RUN ARGS --output-dir OUT` as a terminal starts it: a process group of its own (the ranks get
    sessions of theirs). Each step takes step_s at least (faults.py), so that the run is still training when
    the test acts. With "--config" first in ARGS, `meshlm train ARGS` alone."""
    command = [*args] if args[:1] == ("--config",) else [*RUN, *args, "--output-dir", str(out)]
    job = subprocess.Popen(
        [sys.executable, "-m", "meshlm", "train", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "MESHLM_STEP_SLEEP": str(step_s)},
        start_new_session=True,
    )
    _jobs.append(job)
    return job


def _rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_rows(proc: subprocess.Popen, out: Path, rows: int) -> None:
    end = time.monotonic() + 300
    while _rows(out) < rows:
        assert proc.poll() is None, f"exited {proc.returncode} before {rows} rows: {proc.communicate()}"
        assert time.monotonic() < end, f"no {rows} rows in 300 s"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def _ranks(launcher: int) -> list[int]:
    """The launcher's ranks: the children of its fork server (launch.py)."""
    return [r for child in _children(launcher) for r in _children(child)]


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is dead)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def _interrupted(proc: subprocess.Popen, out: Path, how) -> None:
    """Signal the job `how`; it must stop (its ranks too) with status 130 and one line naming the checkpoint
    saved at the step it stopped."""
    ranks = _ranks(proc.pid)
    how(proc.pid)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    last = metrics(out)[-1]["step"]
    assert _one_line(stderr) == f"meshlm: interrupted (SIGINT); last checkpoint {out / 'checkpoints'}/step-{last}"
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{last}"
    assert not [r for r in ranks if _alive(r)]
    assert "Traceback" not in stdout + stderr


def test_a_run_through_interrupts_a_second_job_a_killed_launcher_and_reruns(tmp_path):
    out = tmp_path / "run"
    # Ctrl-C reaching the launcher only; meanwhile a second job into the same directory is refused.
    job = _start(out, "--nproc", "2", step_s=1.0)  # a second job starts meanwhile
    _wait_for_rows(job, out, 3)
    second = run_meshlm("train", *RUN, "--nproc", "2", "--output-dir", out, check=False)
    assert second.returncode == 2, second.stderr
    held = f"meshlm: error: {out} is in use by another job (host {socket.gethostname()} pid {job.pid} since "
    assert _one_line(second.stderr).startswith(held), second.stderr
    _interrupted(job, out, lambda pid: os.kill(pid, signal.SIGINT))

    # Rerun from its config.toml on one rank: the global batch of 4 is kept (accumulation 2); Ctrl-C to the whole
    # process group.
    config = out / "config.toml"
    assert config.read_text().splitlines()[0] == (
        f"# written by a run on 2 rank(s); `meshlm train --nproc 2 --config {config}` reruns it"
    )
    job = _start(out, "--config", str(config))
    _wait_for_rows(job, out, _rows(out) + 3)
    _interrupted(job, out, lambda pid: os.killpg(pid, signal.SIGINT))
    log = (out / "logs" / "rank-0.log").read_text()
    assert "accumulation 1 -> 2 keeps the global batch of 4 on 1 data-parallel rank(s)" in log
    assert "global batch 4 = micro-batch 2 x accumulation 2 x 1 data-parallel ranks" in log

    # Back on two ranks; the launcher is SIGKILLed (the OOM killer, a closed terminal).
    job = _start(out, "--nproc", "2")
    _wait_for_rows(job, out, _rows(out) + 3)
    ranks = _ranks(job.pid)
    assert len(ranks) == 2
    job.kill()
    end = time.monotonic() + 10
    while any(_alive(r) for r in ranks) and time.monotonic() < end:
        time.sleep(0.1)
    alive = [r for r in ranks if _alive(r)]
    for r in alive:  # leave nothing behind, then fail
        os.kill(r, signal.SIGKILL)
    job.communicate(timeout=60)
    assert not alive, "ranks outlived their launcher by 10 s"

    # Another run into this directory, from scratch, is refused: nothing changes.
    before = tree_digest(out)
    fresh = run_meshlm("train", *RUN, "--nproc", "2", "--resume", "false", "--output-dir", out, check=False)
    assert fresh.returncode == 2
    assert "already holds a run" in _one_line(fresh.stderr) and "--overwrite" in fresh.stderr
    assert tree_digest(out) == before

    # The same command again takes over the dead launcher's lock, resumes where the interrupt saved (the rows the
    # killed run logged after it are dropped) and finishes, each log line on its own line beside the progress bar.
    last = (out / "checkpoints" / "latest").read_text().strip()
    done = run_meshlm("train", *RUN, "--nproc", "2", "--progress", "true", "--output-dir", out)
    log = (out / "logs" / "rank-0.log").read_text()
    assert f"resumed from {out / 'checkpoints' / last} at step {last[5:]}" in log
    dropped = re.search(rf"metrics.jsonl: dropped (\d+) row\(s\) past step {last[5:]}", log)
    assert dropped and int(dropped.group(1)) >= 3, log[-3000:]  # what the killed run logged after step K
    assert f"step {STEPS}: eval_loss " in done.stdout and f"step {STEPS}: eval_loss " in log  # not only metrics
    segments = [seg for line in done.stdout.split("\n") for seg in line.split("\r")]
    assert f"saved {out / 'checkpoints' / f'step-{STEPS}'}" in segments, done.stdout[-2000:]  # not glued to the bar
    before = tree_digest(out)
    again = run_meshlm("train", *RUN, "--nproc", "2", "--output-dir", out)
    assert f"already finished at step {STEPS}" in again.stdout and not again.stderr.strip()
    assert tree_digest(out) == before

    assert [row["step"] for row in metrics(out)] == list(range(1, STEPS + 1))  # once each, through all of it
    assert not (out / ".lock").exists()


def test_ctrl_c_before_any_checkpoint_saves_one(tmp_path):
    """At the defaults (no periodic checkpoint, a save on a signal only when the last is 300 s old) Ctrl-C in a
    run's first minutes saves where it stops: with no checkpoint at all there is nothing newer to keep."""
    out = tmp_path / "run"
    job = _start(out, "--ckpt-on-signal-after", "300", "--ckpt-every", "0")
    _wait_for_rows(job, out, 2)
    _interrupted(job, out, lambda pid: os.kill(pid, signal.SIGINT))


def test_ctrl_c_while_the_ranks_start_is_one_line(tmp_path):
    """Ctrl-C reaches the launcher's whole process group, its fork server too, while that server still imports
    what the ranks need: one line and status 130, no traceback from the server, no leaked-semaphore warning."""
    job = _start(tmp_path / "run", "--nproc", "2")
    end = time.monotonic() + 300
    while not [c for c in _children(job.pid) if b"multiprocessing.forkserver" in _cmdline(c)]:
        assert job.poll() is None, f"exited {job.returncode} before its fork server started: {job.communicate()}"
        assert time.monotonic() < end, "no fork server in 300 s"
        time.sleep(0.01)
    time.sleep(1)  # into its imports (seconds of CPU): the interpreter's own start-up is behind it
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 130, stderr
    assert _one_line(stderr).startswith("meshlm: interrupted (SIGINT)"), stderr
    assert "Traceback" not in stdout + stderr and "leaked" not in stdout + stderr


def test_ctrl_c_with_the_progress_bar_leaks_no_semaphore(tmp_path):
    """With the progress bar (the default), Ctrl-C to the process group: rank 0 leaves without finalisation, and
    the launcher's resource tracker has nothing of it to report (tqdm's multiprocessing lock was one)."""
    out = tmp_path / "run"
    job = _start(out, "--nproc", "2", "--progress", "true")
    _wait_for_rows(job, out, 2)
    _interrupted(job, out, lambda pid: os.killpg(pid, signal.SIGINT))


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def _blocks_without_targets(cfg) -> None:
    """Write the token cache of `cfg`'s dataset as blocks none of which has a target (what packing no longer
    produces), in the cache's own format, so the trainer meets a global batch with nothing to learn."""
    from meshlm.data.builtin import byte_tokenizer
    from meshlm.data.load import cache_dir, cache_key

    tokenizer = byte_tokenizer()
    for part, n in (("train", 16), ("eval", 0)):
        d = cache_dir() / "blocks" / cache_key(cfg, "builtin-bytes", len(tokenizer)) / part
        d.mkdir(parents=True, exist_ok=True)
        ids = np.full((n, cfg.seq_length), 65, dtype=np.int32)
        (d / "ids.bin").write_bytes(ids.tobytes())
        (d / "labels.bin").write_bytes(np.full_like(ids, -100).tobytes())
        (d / "positions.bin").write_bytes(np.tile(np.arange(cfg.seq_length, dtype=np.int32), (n, 1)).tobytes())
        np.save(d / "pads.npy", np.zeros(n, dtype=np.int32))
        meta = {"blocks": n, "seq_length": cfg.seq_length, "documents": n, "split": 0, "truncated": 0}
        (d / "meta.json").write_text(json.dumps({**meta, "no_target": 0}))


def test_a_step_without_targets_leaves_the_weights_alone(tmp_path, capsys):
    """A global batch with no target token makes no optimizer step: after one such step and after two the
    weights are the same (AdamW's weight decay, and its momentum when there is some, would move them on a zero
    gradient, by a different amount each step)."""
    from helpers.checkpoints import read_tensors
    from meshlm import config

    args = [*TINY, "--builtin-samples", "7", "--micro-batch-size", "2", "--weight-decay", "0.5"]
    _blocks_without_targets(config.load(None, config.parse_args(args)))
    saved = {}
    for steps in (1, 2):
        out = tmp_path / f"steps-{steps}"
        deterministic = torch.are_deterministic_algorithms_enabled()
        with pytest.raises(SystemExit) as e, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cli.main(["train", *args, "--max-steps", str(steps), "--output-dir", str(out)])
        torch.use_deterministic_algorithms(deterministic)
        assert e.value.code == 0
        assert f"step {steps}: the global batch has no target token; skipped the update" in capsys.readouterr().out
        assert not [w for w in seen if "lr_scheduler" in str(w.message)]  # the skipped step is not torch's mistake
        state = read_tensors(out / "checkpoints" / f"step-{steps}" / "state")
        saved[steps] = {k: v for k, v in state.items() if k.startswith("model.")}
    assert saved[1] and saved[1].keys() == saved[2].keys()
    for k in saved[1]:
        assert torch.equal(saved[1][k], saved[2][k]), k


def _train_here(capsys, *args: str) -> str:
    """`meshlm train ARGS` in this process (it must succeed); what it printed."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *args])
    torch.use_deterministic_algorithms(deterministic)
    printed = capsys.readouterr()
    assert e.value.code == 0, printed.err[-3000:]
    return printed.out + printed.err


def test_a_run_resumed_on_changed_data_starts_a_new_epoch_of_it(tmp_path, capsys):
    """The dataset file shrinks between a run and its rerun (the step it resumes at lies past the new epoch's end:
    a StopIteration traceback before): the rerun says so and trains from the start of the next epoch over the
    new blocks. On the same data again, or from a checkpoint that did not record its data (older meshlm), it goes
    on where it stood."""
    from meshlm.data.builtin import corpus

    data = tmp_path / "d.jsonl"
    records = [json.dumps(r) for r in corpus(120, 0)]
    data.write_text("\n".join(records))
    out = tmp_path / "run"
    args = [*TINY, "--dataset-name", str(data), "--micro-batch-size", "2", "--output-dir", str(out)]
    _train_here(capsys, *args, "--max-steps", "12")
    data.write_text("\n".join(records[:20]))  # a sixth of the records: step 12 lies past the new epoch's end
    printed = _train_here(capsys, *args, "--max-steps", "14")
    changed = "the training data is not what step 12 trained on ("
    assert changed in printed and "the run goes on from the start of epoch 1 over the new blocks" in printed
    meta = json.loads((out / "checkpoints" / "step-14" / "trainer.json").read_text())
    assert meta["state"]["epoch"] == 1 and meta["state"]["step_in_epoch"] == 2
    assert "the training data is not" not in _train_here(capsys, *args, "--max-steps", "15")
    saved = out / "checkpoints" / "step-15" / "trainer.json"  # as older meshlm wrote it, past this epoch's end
    meta = json.loads(saved.read_text())
    blocks = meta.pop("data")["blocks"]
    meta["state"]["step_in_epoch"] = 40
    saved.write_text(json.dumps(meta))
    (saved.parent / "MANIFEST.json").unlink()  # older meshlm wrote no manifest either
    printed = _train_here(capsys, *args, "--max-steps", "16")
    assert f"(blocks it did not record; now {blocks}: " in printed and "not from step 40 of epoch 1" in printed
    assert [row["step"] for row in metrics(out)] == list(range(1, 17))
