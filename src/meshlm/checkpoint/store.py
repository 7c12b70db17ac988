"""Checkpoints: sharded (torch.distributed.checkpoint), atomic, with a `latest` pointer.

Layout of checkpoints/step-N/:
  state/        model + optimizer, written by DCP: each rank writes only what it
                owns (replicated tensors once, by rank 0), so any layout can load it
  trainer.json  step, epoch, sampler position, scheduler, model fingerprint (rank 0)
  rng/rank-K.pt RNG states of every rank
  MANIFEST.json size and sha256 of every file above (integrity.py)
  COMPLETE      written last: a step-N without it is an interrupted save

Everything goes to .tmp-step-N first, is flushed to disk (os.fsync: files, then
their directories) and renamed when complete; only then does `latest` (a
one-line file replaced atomically, flushed too) move. A crash at any point,
power loss included, leaves the previous `latest` intact; what it left
half-written has no COMPLETE marker and is removed by the next run. A failed
write (disk full, permissions) stops every rank with one line naming the path.
Resuming checks the files against MANIFEST.json first: a checkpoint changed
since its save (a damaged disk, a cut copy) is passed over for the newest older
complete one that is whole, said in one line. Loading never unpickles arbitrary
objects (safe_load.py).
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from meshlm import files
from meshlm.checkpoint import integrity
from meshlm.checkpoint.integrity import MARKER, step_named_by_latest
from meshlm.errors import MeshlmError
from meshlm.models.source import check_fingerprint
from meshlm.runtime import Runtime, agree_on_error, barrier, injected_faults, log

# Optimizer state keyed by parameter name, not by param-group position: layouts group parameters
# differently (tensor parallel keeps DTensors and plain tensors in separate groups).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
META_FIELDS = ("state", "scheduler", "fingerprint")  # what trainer.json must hold
# trainer.json as this process read it, by path, with the file's identity then: a resume looks at it from the
# launcher's checks, the run directory's, continuity's and the load, and it is parsed once per process.
_META_READ: dict[Path, tuple[tuple[int, int, int], dict]] = {}


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in the current epoch (layout-independent)
    nonfinite_skipped: int = 0  # steps skipped for a non-finite loss so far (--skip-nonfinite)
    best_eval_loss: float | None = None  # the lowest eval_loss so far (--keep-best, --early-stopping-patience)
    best_step: int = 0
    evals_since_best: int = 0


def _rng_state() -> dict:
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _write_failure(e: BaseException, tmp: Path) -> str | None:
    """The text "PATH: reason" when `e` is a failed write (disk full, permissions), None when it is something else.

    torch.save's zip writer turns the OSError of a short write into a RuntimeError ("unexpected pos")
    with the OSError as context, and DCP wraps every rank's failure in a CheckpointException; between
    ranks the context is lost in pickling, so the text is the last clue.
    """
    from meshlm.checkpoint import safe_load  # a failed save only

    for x in safe_load.error_chain(e):
        if isinstance(x, OSError):
            return f"{x.filename or tmp}: {x.strerror or x}"
    if "unexpected pos" in str(e):
        return f"{tmp}: a write was cut short (disk full or a file size limit?)"
    return None


def _attempt(path: Path, fn) -> tuple[BaseException | None, str | None]:
    """Run fn; (the exception, or None; the one-line error when the exception means the checkpoint is
    unreadable or refused, or None)."""
    try:
        fn()
    except MeshlmError as e:
        return e, str(e)
    except (Exception, CheckpointException) as e:  # CheckpointException: DCP's wrapper of every rank's failure
        from meshlm.checkpoint import safe_load

        reason = safe_load.unreadable(path / "state", e)
        return e, reason and f"checkpoint {path} cannot be loaded (corrupt or missing shards): {reason}"
    return None, None


def _agree_on_load(path: Path, error: BaseException | None, usage: str | None) -> None:
    """Every rank learns every rank's outcome. An unreadable checkpoint: the same one line everywhere
    (exit 2). Any other failure keeps its traceback on its rank; the others stop with a line naming it."""
    mine = (usage, None) if usage else (None, f"{type(error).__name__}: {error}") if error else (None, None)
    outcomes = [mine]
    if dist.is_initialized():
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, mine)
    line = next((u for u, _ in outcomes if u), None)
    if line:
        raise MeshlmError(line)
    if error is not None:
        raise error
    failed = next(((r, e) for r, (_, e) in enumerate(outcomes) if e), None)
    if failed:
        raise RuntimeError(
            f"rank {failed[0]} failed to load checkpoint {path} (its error is the cause): {failed[1].splitlines()[0]}"
        )


def _step(path: Path) -> int:
    return int(path.name.split("-")[1])


def _complete_steps(root: Path) -> list[Path]:
    """The complete step-N directories of `root`, oldest first."""
    found = (p for p in root.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / MARKER).is_file())
    return sorted(found, key=_step)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_meta(path: Path) -> dict:
    """trainer.json of checkpoint `path`, through the guarded reader; its parts that loading reads must be
    objects. Read once per process (a copy each call): again only when the file changed since."""
    file = path / "trainer.json"
    try:
        st = file.stat()
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        identity = None  # the reader says what is wrong with it
    cached = _META_READ.get(file)
    if identity is None or cached is None or cached[0] != identity:
        meta = files.read_json(file, dict, need=META_FIELDS)
        wrong = [k for k in META_FIELDS if not isinstance(meta[k], dict)]
        if wrong:
            raise MeshlmError(f"{file}: {', '.join(wrong)} not a JSON object; resume from another checkpoint")
        cached = _META_READ[file] = (identity, meta)
    return copy.deepcopy(cached[1])


class CheckpointDir:
    """A run's checkpoints/ directory: finds the complete checkpoint `latest` names, checks its model, writes
    one step atomically, removes interrupted saves and keeps the newest --keep-last."""

    def __init__(self, root: Path, rt: Runtime, keep_last: int = 0, adapters_only: bool = False):
        """adapters_only: a LoRA run's, whose checkpoints hold its adapters (the frozen base never changes)."""
        self.root, self.rt, self.keep_last, self.adapters_only = root, rt, keep_last, adapters_only

    # ---------------------------------------------------------------- find
    def latest(self) -> Path | None:
        """The complete checkpoint `latest` names, or None. Never returns a half-written one."""
        path = step_named_by_latest(self.root)
        if path is not None and not (path / MARKER).is_file():
            pointer = self.root / "latest"
            raise MeshlmError(
                f"checkpoint {path} named by {pointer} is incomplete or missing; "
                f"point {pointer} at a complete step-N directory or remove it"
            )
        return path

    def best(self) -> Path | None:
        """The checkpoint checkpoints/best names (--keep-best), or None."""
        return step_named_by_latest(self.root, "best")

    def point_best(self, path: Path) -> None:
        """checkpoints/best names `path`, a complete checkpoint: replaced atomically, flushed."""
        if self.rt.is_main:
            pointer_tmp = self.root / ".best.tmp"
            _write_synced(pointer_tmp, path.name + "\n")
            os.replace(pointer_tmp, self.root / "best")
            integrity.fsync_dir(self.root)
        barrier()

    def resumable(self, deep: bool = True) -> Path | None:
        """The checkpoint to resume from: the one `latest` names or, when its files are damaged (integrity.py,
        or a trainer.json that does not read), the newest older complete one that is whole, said in one line
        (with deep; the launcher's shallow look before the ranks start says nothing). None without `latest`."""
        named = self.latest()
        if named is None:
            return None
        older = [p for p in _complete_steps(self.root) if _step(p) < _step(named)]
        first = None
        for path in [named, *reversed(older)]:
            reason = self._damage(path, deep)
            if reason is None:
                if first and deep and self.rt.is_main:
                    log.warning(f"checkpoint {named} is damaged ({first}); resuming from {path.name} instead")
                return path
            first = first or reason
        raise MeshlmError(
            f"checkpoint {named} is damaged ({first}) and no older complete checkpoint is whole; "
            f"restore it from a copy, or start over with --overwrite"
        )

    def _damage(self, path: Path, deep: bool) -> str | None:
        """Why the checkpoint cannot be resumed from, as a clause naming the file; None when it can."""
        reason = integrity.damage(path, deep)
        if reason is None:
            try:
                read_meta(path)
            except MeshlmError as e:
                reason = str(e).split(";")[0]
        return reason

    def remove_incomplete(self) -> None:
        """Warn about and delete what interrupted saves left (no COMPLETE marker); never what `latest` names."""
        if self.rt.is_main and self.root.is_dir():
            keep = step_named_by_latest(self.root)
            for path in sorted(self.root.glob("*step-*")):
                if (
                    path.is_dir()
                    and path != keep
                    and re.fullmatch(r"(\.tmp-)?step-\d+", path.name)
                    and not (path / MARKER).is_file()
                ):
                    log.warning(f"removing {path}: an interrupted save (no {MARKER} marker), not resumable")
                    shutil.rmtree(path, ignore_errors=True)
        barrier()

    def check_model(self, path: Path, fingerprint: dict) -> dict:
        meta = read_meta(path)
        check_fingerprint(meta.get("fingerprint"), fingerprint, path, "use a new --output-dir or the matching model")
        return meta

    # ---------------------------------------------------------------- save
    def save(self, step: int, model, optimizer, scheduler, state: TrainState, fingerprint: dict, extra: dict) -> Path:
        final = self.root / f"step-{step}"
        tmp = self.root / f".tmp-step-{step}"
        self._write(tmp, lambda: self._prepare(tmp))
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
        model_sd = self._saved_part(model_sd)

        def shards():
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"))
            with open(tmp / "rng" / f"rank-{self.rt.rank}.pt", "wb") as f:  # a file object keeps the OSError
                torch.save(_rng_state(), f)
            if self.rt.is_main:
                meta = {
                    "state": asdict(state),
                    "scheduler": scheduler.state_dict(),
                    "fingerprint": fingerprint,
                    "world_size": self.rt.world_size,
                    **extra,
                }
                (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))

        self._write(tmp, shards)  # agreeing on success is also the barrier: every rank's shards are on disk
        self._write(tmp, lambda: integrity.write_manifest(tmp, self.rt))
        if (faults := injected_faults()) is not None:
            faults.pause_in_save(step)
        self._write(tmp, lambda: self._publish(tmp, final))
        self.retain()
        barrier()
        return final

    def _write(self, tmp: Path, fn) -> None:
        """Run a part of the save on every rank; any rank's OSError stops all of them with one line."""
        error = None
        try:
            fn()
        except (OSError, RuntimeError, CheckpointException) as e:
            failure = _write_failure(e, tmp)
            if failure is None:
                raise
            error = (
                f"could not write checkpoint {failure}; free space or fix permissions, then rerun to resume "
                f"from checkpoints/latest"
            )
            if self.rt.is_main:  # a half-written step must not fill the disk further
                shutil.rmtree(tmp, ignore_errors=True)
        agree_on_error(error)  # every rank raises the same line, so none waits in a barrier

    def _prepare(self, tmp: Path) -> None:
        if self.rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)

    def _publish(self, tmp: Path, final: Path) -> None:
        """COMPLETE marker, rename into place, then move `latest`: each step atomic, in this order."""
        if not self.rt.is_main:
            return
        _write_synced(tmp / MARKER, "")
        integrity.fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        integrity.fsync_dir(self.root)  # the rename is durable before `latest` names it
        pointer_tmp = self.root / ".latest.tmp"
        _write_synced(pointer_tmp, final.name + "\n")
        os.replace(pointer_tmp, self.root / "latest")
        integrity.fsync_dir(self.root)

    def retain(self) -> None:
        """--keep-last K: delete all but the newest K complete checkpoints, never the one `latest` names."""
        if not (self.keep_last and self.rt.is_main):
            return
        keep = {self.latest(), self.best()}
        for path in _complete_steps(self.root)[: -self.keep_last]:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def _saved_part(self, model_sd: dict) -> dict:
        if not self.adapters_only:
            return model_sd
        from meshlm.parallel.lora import saved_part

        return saved_part(model_sd)

    # ---------------------------------------------------------------- load
    def load(self, path: Path, model, optimizer, scheduler, state: TrainState) -> None:
        from meshlm.checkpoint import safe_load  # resuming only

        meta = read_meta(path)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
        sd = {"model": self._saved_part(model_sd), "optim": optim_sd}
        # Two phases, each ended by every rank agreeing on the outcome: a rank that failed must not
        # leave the others in DCP's collectives (or the next barrier) until the timeout.
        _agree_on_load(path, *_attempt(path, lambda: safe_load.check_metadata(path / "state")))

        def read():
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                safe_load.load(sd, path / "state")
            if (faults := injected_faults()) is not None:
                faults.in_load(self.rt.rank)
            partial = len(sd["model"]) < len(model_sd)  # LoRA: the adapters alone; the base stays as built
            set_state_dict(
                model,
                optimizer,
                model_state_dict=sd["model"],
                optim_state_dict=sd["optim"],
                options=replace(OPTIONS, strict=not partial),
            )

        _agree_on_load(path, *_attempt(path, read))
        sched = dict(meta["scheduler"])
        if len(sched.get("base_lrs", ())) != len(optimizer.param_groups):
            # One entry per param group, and layouts group parameters differently (tensor parallel keeps
            # plain tensors and DTensors apart). Both follow from --lr and the step: recomputed here.
            sched.pop("base_lrs")
            sched.pop("_last_lr", None)
        scheduler.load_state_dict(sched)
        for k, v in meta["state"].items():
            setattr(state, k, v)
        rng, error = self._read_rng(path, meta)
        agree_on_error(error)
        if rng is not None:
            _set_rng_state(rng)
        else:  # another layout: the data order is still exact; only dropout-like randomness reseeds
            torch.manual_seed(1_000_003 * state.step + self.rt.rank)
        if dist.is_initialized():
            barrier()

    def _read_rng(self, path: Path, meta: dict) -> tuple[dict | None, str | None]:
        """(this rank's RNG state, or None under another layout; the one line when its file is damaged)."""
        rng = path / "rng" / f"rank-{self.rt.rank}.pt"
        if not (rng.is_file() and meta.get("world_size") == self.rt.world_size):
            return None, None
        try:
            return torch.load(rng, weights_only=True), None
        except Exception as e:  # a cut or overwritten file: torch's zip reader and unpickler raise many kinds
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            return None, f"{rng} is corrupt ({reason}); resume from another checkpoint"
