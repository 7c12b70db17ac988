"""`meshlm verify`'s layouts: the cases a rank count allows, the config keys that ask for each, and why one
cannot run here, decided before any process starts (verify.py runs them, verify_compare.py judges them).

A Case keeps its own data-parallel count and keys rather than reading them from `layout.resolve`: it asks for
the strategy as given ("auto" included) so that each run resolves it as a user's would, and `unavailable` says
that a global batch does not split before `resolve` rejects the layout for other reasons.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from meshlm.config import SCHEDULES, Config, check_grpo_layout, check_grpo_tiling, set_key, to_args
from meshlm.errors import MeshlmError
from meshlm.layout import Layout, degrees, resolve, strategy_for

# Fixed by verify itself; a user setting them would make the runs incomparable.
CONTROLLED = (
    "strategy",
    "micro_batch_size",
    "max_steps",
    "mixed_precision",
    "devices",
    "log_every",
    "resume",
    "save_final",
    "ckpt_every",
    "progress",
    "wandb",
    "tensorboard",
    "dropout_off",
    "grpo.replay",  # --objective grpo: every layout replays the reference's completions
)

# `meshlm verify tiny`: small enough for CI, deep and wide enough for every layout on 4 ranks
# (8 layers: 4 pipeline stages x 2 virtual stages; 8 heads / 4 kv heads: tensor parallel 4).
PRESETS = {
    "tiny": [
        "--arch.hidden-size",
        "64",
        "--arch.layers",
        "8",
        "--arch.heads",
        "8",
        "--arch.kv-heads",
        "4",
        "--arch.intermediate-size",
        "128",
        "--seq-length",
        "64",
        "--builtin-samples",
        "400",
    ],
    "default": [],
}


@dataclass(frozen=True)
class Case:
    """One layout verify runs: the config keys that ask for it, and its ranks."""

    name: str
    nproc: int  # 0: one process (no launcher)
    strategy: str = "auto"
    tp: int = 1
    pp: int = 1
    shard_size: int = 0
    schedule: str = ""
    devices: str = ""
    ep: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return max(1, self.nproc) // (self.tp * self.pp * self.cp)

    @property
    def layout(self) -> Layout:
        """The layout the keys resolve to (degrees only; `unavailable` runs every check)."""
        world = max(1, self.nproc)
        strategy = strategy_for(self.strategy, world, self.tp, self.pp, self.ep, cp=self.cp)
        return Layout(strategy, degrees(strategy, world, self.tp, self.pp, self.shard_size, self.ep, cp=self.cp))

    def keys(self, global_batch: int, grad_accum: int) -> list[tuple[str, object]]:
        """Config keys of this layout, the micro-batch that keeps the global batch the same."""
        keys = [
            ("strategy", self.strategy),
            ("micro_batch_size", global_batch // (self.dp * grad_accum)),
            ("parallel.tp", self.tp),
            ("parallel.pp", self.pp),
        ]
        keys += [("parallel.shard_size", self.shard_size)] * bool(self.shard_size)
        keys += [("parallel.cp", self.cp)] * (self.cp > 1)
        keys += [("parallel.schedule", self.schedule)] * bool(self.schedule)
        keys += [("parallel.ep", self.ep)] * (self.ep > 1)
        return keys + [("devices", self.devices)] * bool(self.devices)

    def train_args(self, global_batch: int, grad_accum: int) -> list[str]:
        return to_args(self.keys(global_batch, grad_accum)) + ["--nproc", str(self.nproc)] * bool(self.nproc)


REFERENCE = Case("single", 0, "single")


def layouts(world: int, gpus: int, experts: bool = False) -> list[Case]:
    """Every layout `world` ranks allow, single-process ones first, then 1-D, then compositions; for a mixture
    of `experts` also expert parallel and its compositions."""
    devices = ",".join(f"cuda:{i}" for i in range(gpus)) if gpus >= 2 else ",".join(["cpu"] * max(2, world))
    out = [Case("dp", 0, "dp"), Case("layer-split", 0, "layer-split", devices=devices)]
    if world < 2:
        return out
    out += [Case(s, world, s) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")]
    if world % 2 == 0:  # on 2 ranks a "not available" row says why (unavailable)
        out.append(Case("hsdp", world, "hsdp", shard_size=world // 2))
    out.append(Case("tp", world, tp=world))
    out += [Case(f"pp-{s.replace('-1f1b', '')}", world, pp=world, schedule=s) for s in SCHEDULES]
    if world >= 4 and world % 2 == 0:
        out += [
            Case("fsdp+tp", world, "fsdp", tp=2),
            Case("ddp+pp", world, "ddp", pp=2),
            Case("fsdp+pp", world, "fsdp", pp=2),
            Case("tp+pp", world, tp=2, pp=world // 2),
        ]
    if world >= 8 and world % 8 == 0:
        out.append(Case("fsdp+tp+pp", world, "fsdp", tp=2, pp=2))
    out.append(Case("cp", world, cp=world))  # each sequence over every rank (parallel/context.py)
    if world >= 4 and world % 2 == 0:
        out += [
            Case("ddp+cp", world, "ddp", cp=2),
            Case("fsdp+cp", world, "fsdp", cp=2),
            Case("tp+cp", world, tp=2, cp=2),
            Case("pp+cp", world, pp=2, cp=2),
        ]
    if experts:
        out.append(Case("ep", world, "fsdp", ep=world))
    if experts and world >= 4 and world % 2 == 0:
        out += [
            Case("ep+fsdp", world, "fsdp", ep=2),
            Case("ep+tp", world, "fsdp", tp=2, ep=2),
            Case("ep+pp", world, "fsdp", pp=2, ep=2),
        ]
    if experts and world % 4 == 0:  # ep 2 over the data-parallel ranks of each cp rank: world / 2 of them
        out.append(Case("ep+cp", world, "fsdp", cp=2, ep=2))
    return out


def unavailable(case: Case, cfg: Config, global_batch: int, gpus: int = 0) -> str:
    """Why meshlm cannot run this layout here ('' when it can), decided before any process starts."""
    if gpus and case.nproc > gpus:
        return f"not available: {case.nproc} ranks need {case.nproc} GPUs, {gpus} visible"
    if case.strategy == "hsdp" and case.nproc < 4:
        return (
            f"not available: hsdp needs 4 ranks or more (shards within groups, replicas across groups); on "
            f"{case.nproc} it is ddp (shard size 1) or zero3 (shard size {case.nproc})"
        )
    if global_batch % (case.dp * cfg.grad_accum):
        return (
            f"not available: global batch {global_batch} does not split over {case.dp} data-parallel ranks "
            f"x {cfg.grad_accum} accumulation steps"
        )
    trial = copy.deepcopy(cfg)
    for k, v in case.keys(global_batch, cfg.grad_accum):
        set_key(trial, k, v)
    try:
        resolve(trial, max(1, case.nproc))
        if cfg.objective == "grpo":  # the layouts that generate, and whole groups on each rank
            check_grpo_layout(trial)
            check_grpo_tiling(trial)
    except MeshlmError as e:
        return f"not available: {e}"
    return ""
