"""One run per output directory, one job at a time, one metrics row per step.

- A directory that holds a run is resumed, or refused with `--resume false` unless `--overwrite` says to
  delete that run first (`check`, before anything is written).
- While a job runs, `<output-dir>/.lock` names its host and pid and is locked (POSIX record lock, which the
  kernel drops when the holder dies, also over NFS). A second job is refused in one line naming the holder;
  the lock of a dead holder is taken over. meshlm's launcher holds it for its ranks; a run started any other
  way (one process, plain torchrun) takes it on rank 0.
- On every start (`prepare`, after the checks), metrics.jsonl and samples.jsonl keep only the rows up to the
  step the run resumes from: what a crash, a kill or an interrupt logged after its last checkpoint is trained
  again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from meshlm.errors import MeshlmError

LOCK = ".lock"
# What a run writes into its directory: what --overwrite deletes (never anything else the directory holds).
RUN_FILES = (
    "metrics.jsonl",
    "samples.jsonl",
    "config.toml",
    "checkpoints",
    "logs",
    "tensorboard",
    "wandb",
    "trace",
    "plots",
    "probe",
)


def holds_run(out: Path) -> bool:
    return any((out / name).exists() for name in ("metrics.jsonl", "config.toml", "checkpoints"))


def takes_lock(node_rank: int = 0) -> bool:
    """Whether this process holds the run directory for its job: node 0's launcher (meshlm's launcher holds it
    for all its ranks), or rank 0 of a job meshlm did not launch (one process, plain torchrun). Only the holder
    looks at the lock: every other process of the job would find it held by its own job (another node's
    launcher, or rank 0) and refuse it."""
    if os.environ.get("MESHLM_LAUNCHED"):
        return False
    return node_rank == 0 and os.environ.get("RANK", "0") == "0"


def check(cfg, node_rank: int = 0) -> None:
    """A directory another job holds: refused by the process that would hold it (looked at, not locked: nothing
    is written yet); the others of its job stop with it. --resume false
    into a directory that holds a run: refused, unless --overwrite. When resuming, what can be told from the
    files alone (no model, no ranks): `latest` names a complete checkpoint, its trainer.json reads, its DCP
    metadata is plain data. (The model's fingerprint and the shards are checked by the ranks.)"""
    from meshlm.config import check_paths

    check_paths(cfg)  # a directory that cannot be written: one line now, not a traceback from the lock
    if takes_lock(node_rank):
        RunLock(cfg.out).refuse_if_held()
    if not cfg.resume and not cfg.overwrite and holds_run(cfg.out):
        raise MeshlmError(
            f"--resume false: {cfg.out} already holds a run (its checkpoints and metrics would mix with this "
            f"one's); use a new --output-dir, or --overwrite to delete that run and start over"
        )
    if cfg.resuming and (cfg.out / "checkpoints" / "latest").is_file():  # else no checkpoint code to import
        from meshlm.checkpoint import safe_load
        from meshlm.checkpoint.store import CheckpointDir
        from meshlm.runtime import Runtime

        store = CheckpointDir(cfg.out / "checkpoints", Runtime())
        latest = store.resumable(deep=False)
        if latest is not None:
            safe_load.check_metadata(latest / "state")


def resumed(cfg) -> dict | None:
    """What the checkpoint this run resumes from recorded (its trainer.json, with "path"), or None."""
    if not (cfg.resuming and (cfg.out / "checkpoints" / "latest").is_file()):
        return None
    from meshlm.checkpoint.store import CheckpointDir, read_meta
    from meshlm.runtime import Runtime

    latest = CheckpointDir(cfg.out / "checkpoints", Runtime()).resumable(deep=False)
    return None if latest is None else {**read_meta(latest), "path": latest}


def finished(cfg) -> str | None:
    """The line to show, when the checkpoint this run would resume from is already at --max-steps (rerunning a
    finished run's command then does nothing, successfully). Not when that checkpoint's files are damaged: the
    ranks then resume from the one before it, and say why."""
    from meshlm.checkpoint import integrity

    meta = resumed(cfg)
    if meta is None or meta["state"]["step"] < cfg.max_steps or integrity.damage(meta["path"], alone=True):
        return None
    return (
        f"already finished at step {meta['state']['step']} ({meta['path']}, --max-steps {cfg.max_steps}); "
        f"raise --max-steps to train on, or use a new --output-dir"
    )


def check_same_model(cfg) -> None:
    """The model this command builds is the one in the checkpoint it would resume from (the line the ranks give
    when they load it): a finished run's command with another model is bad input, not a finished run."""
    from meshlm.models.source import ModelSource, check_fingerprint

    meta = resumed(cfg)
    source = ModelSource.of_config(cfg)
    mine = source.fingerprint(source.on_meta())
    check_fingerprint(meta["fingerprint"], mine, meta["path"], "use a new --output-dir or the matching model")


def prepare(cfg, resumed_step: int) -> int:
    """Rank 0, every input checked: delete the previous run (--overwrite), or drop the metrics rows past the step
    this run resumes from. Returns how many rows were dropped."""
    if cfg.overwrite:
        for name in RUN_FILES:
            path = cfg.out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        return 0
    truncate_metrics(cfg.out / "samples.jsonl", resumed_step)  # --eval-samples' rows: trained again, sampled again
    return truncate_metrics(cfg.out / "metrics.jsonl", resumed_step)


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of steps up to `step` (atomically: a crash leaves the old file or the new one)."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if ln.strip() and _step(ln) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a row cut short by a crash: not a step anybody resumes from
        return 1 << 62


class RunLock:
    """`<out>/.lock`, held from `acquire` to `release`. Creating it creates `out` if needed; releasing removes
    what acquiring created, so a job refused on bad input leaves the file system as it was."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / LOCK
        self.fd: int | None = None
        self.created: list[Path] = []

    def refuse_if_held(self) -> None:
        """Raise when a live job holds the lock; change nothing either way."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            holder = self._lock(fd)  # on success this process holds it until the close below
        finally:
            os.close(fd)
        if holder:
            raise MeshlmError(self._in_use(holder))

    def _in_use(self, holder: str) -> str:
        return (
            f"{self.out} is in use by another job ({holder}); wait for it to end or stop it, or use another "
            f"--output-dir"
        )

    def acquire(self) -> RunLock:
        missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
        self.out.mkdir(parents=True, exist_ok=True)
        self.created = missing  # innermost first: the order to remove them in
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            holder = self._lock(fd)
            if holder:
                os.close(fd)
                self._remove_created()
                raise MeshlmError(self._in_use(holder))
            # The holder may have removed the file between our open and our lock: lock the file that is there.
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} since {since}\n".encode())
        self.fd = fd
        return self

    def _lock(self, fd: int) -> str | None:
        """None when this process now holds the lock, else who does (as the file says)."""
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except OSError as e:
            if e.errno == errno.ENOLCK:  # a file system without locks: a live pid on this host holds it
                return self._live_holder(os.pread(fd, 200, 0).decode(errors="replace").strip())
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "a job that has not written its name yet"

    @staticmethod
    def _live_holder(text: str) -> str | None:
        words = text.split()
        fields = dict(zip(words[::2], words[1::2]))
        if not fields.get("pid", "").isdigit() or int(fields["pid"]) == os.getpid():
            return None
        if fields.get("host") != socket.gethostname():
            return text  # cannot tell from here whether it lives
        try:
            os.kill(int(fields["pid"]), 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return text

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)  # unlinked first: nobody locks the old file after we let it go
        self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        for path in self.created:
            try:
                path.rmdir()  # only if still empty: a run that wrote into it keeps it
            except OSError:
                break
        self.created = []

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
