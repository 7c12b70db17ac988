"""Checkpoints: sharded (torch.distributed.checkpoint), atomic, with a `latest` pointer.

Layout of checkpoints/step-N/:
  state/        model + optimizer, written by DCP: each rank writes only what it
                owns (replicated tensors once, by rank 0), so any layout can load it
  trainer.json  step, epoch, sampler position, scheduler, model fingerprint (rank 0)
  rng/rank-K.pt RNG states of every rank
  COMPLETE      written last: a step-N without it is an interrupted save

Everything goes to .tmp-step-N first and is renamed when complete; only then
does `latest` (a one-line file replaced atomically) move. A crash at any point
leaves the previous `latest` intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from meshlm.errors import MeshlmError
from meshlm.runtime import Runtime, barrier, log

MARKER = "COMPLETE"
# Optimizer state keyed by parameter name, not by param-group position: layouts group parameters
# differently (tensor parallel keeps DTensors and plain tensors in separate groups).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in the current epoch (layout-independent)


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


class Checkpointer:
    def __init__(self, root: Path, rt: Runtime):
        self.root, self.rt = root, rt

    # ---------------------------------------------------------------- find
    def latest(self) -> Path | None:
        """The complete checkpoint `latest` names, or None. Never returns a half-written one."""
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / MARKER).is_file():
            raise MeshlmError(f"checkpoint {path} named by {pointer} is incomplete or missing; "
                              f"point {pointer} at a complete step-N directory or remove it")
        return path

    def read_meta(self, path: Path) -> dict:
        try:
            return json.loads((path / "trainer.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MeshlmError(f"checkpoint {path} is corrupt (trainer.json: {e}); resume from another one") from None

    def check_model(self, path: Path, fingerprint: dict) -> dict:
        meta = self.read_meta(path)
        if meta.get("fingerprint") != fingerprint:
            raise MeshlmError(f"checkpoint {path} is from another model ({meta.get('fingerprint')} vs "
                              f"{fingerprint}); use a new --output-dir or the matching model")
        return meta

    # ---------------------------------------------------------------- save
    def save(self, step: int, model, optimizer, scheduler, state: TrainState, fingerprint: dict, extra: dict) -> Path:
        final = self.root / f"step-{step}"
        tmp = self.root / f".tmp-step-{step}"
        if self.rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"))
        torch.save(_rng_state(), tmp / "rng" / f"rank-{self.rt.rank}.pt")
        if self.rt.is_main:
            meta = {"state": asdict(state), "scheduler": scheduler.state_dict(), "fingerprint": fingerprint,
                    "world_size": self.rt.world_size, **extra}
            (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
        barrier()  # every rank's shards are on disk
        if self.rt.is_main:
            (tmp / MARKER).write_text("")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer_tmp = self.root / ".latest.tmp"
            pointer_tmp.write_text(final.name + "\n")
            os.replace(pointer_tmp, self.root / "latest")
        barrier()
        return final

    # ---------------------------------------------------------------- load
    def load(self, path: Path, model, optimizer, scheduler, state: TrainState) -> None:
        meta = self.read_meta(path)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
        sd = {"model": model_sd, "optim": optim_sd}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(sd, checkpoint_id=str(path / "state"))
        except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps every rank's
            msg = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
            raise MeshlmError(f"checkpoint {path} cannot be loaded (corrupt or missing shards): "
                              f"{msg[-1] if msg else type(e).__name__}") from None
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=OPTIONS)
        sched = dict(meta["scheduler"])
        if len(sched.get("base_lrs", ())) != len(optimizer.param_groups):
            # One entry per param group, and layouts group parameters differently (tensor parallel keeps
            # plain tensors and DTensors apart). Both follow from --lr and the step: recomputed here.
            sched.pop("base_lrs")
            sched.pop("_last_lr", None)
        scheduler.load_state_dict(sched)
        for k, v in meta["state"].items():
            setattr(state, k, v)
        rng = path / "rng" / f"rank-{self.rt.rank}.pt"
        if rng.is_file() and meta.get("world_size") == self.rt.world_size:
            _set_rng_state(torch.load(rng, weights_only=True))
        else:  # another layout: the data order is still exact; only dropout-like randomness reseeds
            torch.manual_seed(1_000_003 * state.step + self.rt.rank)
        log.info(f"resumed from {path} at step {state.step}")
        if dist.is_initialized():
            barrier()
