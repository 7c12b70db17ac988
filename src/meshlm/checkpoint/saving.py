"""When the run saves and what: the checkpoint cadence and the objects a checkpoint holds.

store.py writes and reads one checkpoint (atomic, agreed on by every rank); this
decides when (every --ckpt-every steps, and at the end with --save-final), resumes from
checkpoints/latest, and keeps the model, optimizer, scheduler and counters it saves.
"""

from __future__ import annotations

from pathlib import Path

from meshlm.checkpoint.store import CheckpointDir, TrainState
from meshlm.config import Config, lora_on
from meshlm.layout import Layout
from meshlm.runtime import Runtime, log


class SaveAndResume:
    """The run's side of checkpoints: resumes from checkpoints/latest (or the newest whole one before it, when
    its files are damaged; checked against the model first), holds
    what a checkpoint saves, and saves it when due."""

    def __init__(self, cfg: Config, rt: Runtime, fingerprint: dict, layout: Layout, data: dict):
        """data: the training blocks' identity (data/pack.py Blocks.identity), recorded with each checkpoint."""
        self.cfg, self.fingerprint, self.layout, self.data = cfg, fingerprint, layout, data
        self.store = CheckpointDir(cfg.out / "checkpoints", rt, cfg.keep_last, adapters_only=lora_on(cfg.lora))
        self.resume_from = self.store.resumable() if cfg.resuming else None
        self.resumed: dict | None = None  # what the checkpoint resumed from recorded (its trainer.json)
        self.saved_step: int | None = None  # the step this run last saved
        if self.resume_from:  # checked before the model is parallelized: a wrong model stops the run now
            self.resumed = self.store.check_model(self.resume_from, fingerprint)

    def hold(self, engine, optimizer, scheduler, state: TrainState) -> None:
        """What every checkpoint saves; loaded from checkpoints/latest now when resuming."""
        self.engine, self.optimizer, self.scheduler, self.state = engine, optimizer, scheduler, state
        if self.resume_from:
            self.store.load(self.resume_from, engine.module, optimizer, scheduler, state)

    def due(self, step: int) -> bool:
        every = self.cfg.ckpt_every and step % self.cfg.ckpt_every == 0
        return bool(every or (step == self.cfg.max_steps and self.cfg.save_final))

    def maybe_save(self, step: int) -> Path | None:
        return self.save_once(step) if self.due(step) else None

    def save_once(self, step: int) -> Path:
        """The checkpoint of `step`: written now, unless it was already (--keep-best saves at evaluations)."""
        saved = self.store.root / f"step-{step}"
        return saved if self.saved_step == step else self.save(step)

    def save(self, step: int) -> Path:
        path = self.store.save(
            step,
            self.engine.module,
            self.optimizer,
            self.scheduler,
            self.state,
            self.fingerprint,
            # what a resumed run keeps (checkpoint/continuity.py)
            {
                "strategy": self.layout.strategy,
                "global_batch": self.cfg.global_batch_size,
                "lr_schedule_steps": self.cfg.lr_schedule_steps,
                "data": self.data,
            },
        )
        log.info(f"saved {path}")
        self.saved_step = step
        return path
