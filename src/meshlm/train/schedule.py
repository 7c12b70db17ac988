"""The learning rate: scaled with the global batch (--scale-lr), warmed up linearly, then decayed on a cosine."""

from __future__ import annotations

import math
import re
import warnings

from meshlm.config import Config


def lr_lambda(cfg: Config):
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak at the end of the schedule's span
    (--lr-schedule-steps, else --max-steps)."""
    span = cfg.lr_schedule_steps or cfg.max_steps

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, span - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def scaled_lr(cfg: Config, global_batch: int) -> float:
    ratio = global_batch / cfg.base_batch_size
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.scale_lr]


def advance_schedule(scheduler, stepped: bool) -> None:
    """One step of the learning-rate schedule, which follows the step count whether or not the optimizer stepped
    (a batch without targets, a non-finite loss): torch warns of a wrong order when the run's first step was
    skipped, which it was not."""
    with warnings.catch_warnings():
        if not stepped:
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"), UserWarning)
        scheduler.step()
