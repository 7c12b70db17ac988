"""Pipeline parallel: consecutive blocks on consecutive ranks, micro-batches flowing through them.

The model is cut into stages (models/stages.py: balanced by parameter count, or
by hand with --parallel.pp-split); each rank keeps its own and drops the rest.
Here: the split, the schedule's shape (micro-batches, virtual stages) and its
checks; engines/pipeline.py runs the schedule.
"""

from __future__ import annotations

from torch import nn

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.models.families import pipeline_parts
from meshlm.models.stages import Stage, build_stages, keep_only, parse_split


def virtual_stages(cfg: Config) -> int:
    return cfg.parallel.virtual_stages if cfg.parallel.schedule == "interleaved-1f1b" else 1


def split_for_rank(model: nn.Module, cfg: Config, pp_rank: int) -> list[Stage]:
    """This rank's stages, with the rest of `model` dropped. Interleaved ("looped") placement: rank r
    holds stages r, r + pp, r + 2 pp, ..."""
    pp, virtual = cfg.parallel.pp, virtual_stages(cfg)
    stages = build_stages(model, pp * virtual, cfg.parallel.pp_split)
    mine = [stages[pp_rank + v * pp] for v in range(virtual)]
    keep_only(model, mine)
    return mine


def micro_batches(cfg: Config) -> int:
    return cfg.parallel.micro_batches or 2 * cfg.parallel.pp


def check_pipeline(cfg: Config, model_config) -> None:
    """One-line errors for splits and schedules that cannot run, before any rank starts (no hangs)."""
    pp, m, sched = cfg.parallel.pp, micro_batches(cfg), cfg.parallel.schedule
    pipeline_parts(model_config, "pipeline parallel")
    n_stages, layers = pp * virtual_stages(cfg), model_config.num_hidden_layers
    if n_stages > layers:
        raise MeshlmError(
            f"{n_stages} pipeline stages need at least {n_stages} layers; the model has {layers}: "
            f"lower --parallel.pp or --parallel.virtual-stages"
        )
    if cfg.parallel.pp_split:
        parse_split(cfg.parallel.pp_split, n_stages, layers)
    if cfg.micro_batch_size % m:
        raise MeshlmError(
            f"--micro-batch-size {cfg.micro_batch_size} does not split into --parallel.micro-batches "
            f"{m} equal pipeline micro-batches; use a micro-batch size that is a multiple of {m}"
        )
    if sched == "1f1b" and m < pp:
        raise MeshlmError(
            f"--parallel.schedule 1f1b needs at least pp = {pp} micro-batches, got "
            f"--parallel.micro-batches {m}; raise it or use --parallel.schedule gpipe"
        )
    if sched == "interleaved-1f1b":
        if cfg.parallel.virtual_stages < 2:
            raise MeshlmError("--parallel.schedule interleaved-1f1b needs --parallel.virtual-stages 2 or more")
        rounds = max(1, m // pp)
        if m % rounds:
            raise MeshlmError(
                f"--parallel.schedule interleaved-1f1b runs micro-batches in rounds of pp = {pp}; "
                f"--parallel.micro-batches {m} is not a multiple of {rounds} rounds: "
                f"use a multiple of {pp}"
            )
