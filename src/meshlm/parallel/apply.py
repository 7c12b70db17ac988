"""Apply the parallel techniques to a model in one fixed order.

Order matters and is the same everywhere (as in torchtitan):
  1. tensor parallel   - rewrites Linear weights into DTensor shards; must see the plain model
  2. activation ckpt   - wraps whole blocks, so it goes after TP changed their insides
  3. compile           - compiles the wrapped blocks
  4. FSDP / DDP        - outermost: shards or replicates whatever the blocks now are
Pipeline parallel splits the model before all of these; each stage is then treated
like a model of its own.
"""

from __future__ import annotations

import torch

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.models.blocks import transformer_blocks
from meshlm.models.meta_init import materialize
from meshlm.parallel.checkpointing import apply_activation_checkpointing
from meshlm.parallel.engine import Engine
from meshlm.parallel.fsdp import FSDP_STRATEGIES, FSDPEngine, check_cpu_offload, one_rank_mesh
from meshlm.parallel.mesh import Degrees, build_mesh, degrees, resolve_strategy
from meshlm.runtime import Runtime, log

SUPPORTED = ("single", "dp", "ddp", "zero1") + FSDP_STRATEGIES


def plan_degrees(cfg: Config, world: int) -> tuple[str, Degrees]:
    """Strategy and degrees for `world` ranks, checked before any process or model exists."""
    strategy = resolve_strategy(cfg, world)
    if strategy not in SUPPORTED:
        raise MeshlmError(f"--strategy {strategy} is not available yet; supported: {', '.join(SUPPORTED)}")
    check_cpu_offload(cfg.cpu_offload, strategy, torch.cuda.is_available() and cfg.backend != "gloo")
    return strategy, degrees(cfg, world)


def build_device(cfg: Config, rt: Runtime) -> torch.device | str:
    """Where this rank builds the model. Sharded layouts on more than one rank: rank 0 on the CPU (its
    full copy, random or pretrained, never needs the accelerator) and the others on the meta device,
    shapes only; after sharding each rank gets its part of rank 0's weights (models/meta_init.py)."""
    if rt.world_size > 1 and resolve_strategy(cfg, rt.world_size) in FSDP_STRATEGIES:
        return "cpu" if rt.is_main else "meta"
    return rt.device


def parallelize(model, cfg: Config, rt: Runtime) -> Engine:
    strategy, d = plan_degrees(cfg, rt.world_size)
    mesh = build_mesh(rt.device.type, d) if rt.world_size > 1 else None
    sharded = strategy in FSDP_STRATEGIES
    if sharded and mesh is None:
        mesh = one_rank_mesh(rt.device)
    # rank 0's real weights, taken before anything rewrites the parameters (ranks > 0 are on meta)
    full_state = model.state_dict() if sharded and rt.world_size > 1 and rt.is_main else None

    # 1. tensor parallel: not here yet
    # 2. activation checkpointing
    wrapped = apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if wrapped:
        log.info(f"activation checkpointing: {wrapped} of {len(transformer_blocks(model))} blocks "
                 f"recompute their activations in backward")
    # 3. compile: not here yet
    # 4. FSDP / DDP
    if strategy == "dp":
        from meshlm.parallel.dp import DataParallelEngine

        return DataParallelEngine(model, cfg, rt)
    if sharded:
        engine = FSDPEngine(model, cfg, rt, mesh, strategy)
        if rt.world_size > 1:
            materialize(model, full_state, torch.device("cpu") if cfg.cpu_offload else rt.device)
        return engine
    if mesh is None:  # one rank: ddp and zero1 are the single-device run
        return Engine(model, cfg, rt)
    if strategy == "ddp":
        from meshlm.parallel.ddp import DDPEngine

        return DDPEngine(model, cfg, rt, mesh)
    if strategy == "zero1":
        from meshlm.parallel.zero1 import ZeroOneEngine

        return ZeroOneEngine(model, cfg, rt, mesh)
    return Engine(model, cfg, rt, mesh)
