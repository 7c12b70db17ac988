"""Apply the parallel techniques to a model in one fixed order.

Order matters and is the same everywhere (as in torchtitan):
  0. pipeline split    - keeps this rank's stages and drops the rest of the model
  1. tensor parallel   - rewrites Linear weights into DTensor shards; must see the plain model
  2. activation ckpt   - wraps whole blocks, so it goes after TP changed their insides
  3. compile           - compiles the wrapped blocks
  4. FSDP / DDP        - outermost: shards or replicates whatever the blocks now are
Under a pipeline, steps 1-4 apply to each stage, which is then a model of its own.
All of it happens on one DeviceMesh (pp, dp_replicate, dp_shard, tp) from mesh.py.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.models.blocks import transformer_blocks
from meshlm.models.materialize import InitialWeights, materialize, on_meta
from meshlm.parallel.checkpointing import apply_activation_checkpointing
from meshlm.parallel.engine import Engine
from meshlm.parallel.fsdp import (FSDP_STRATEGIES, FSDPEngine, apply_fsdp, check_cpu_offload, mixed_precision_policy,
                                  one_rank_mesh)
from meshlm.parallel.mesh import Degrees, Mesh, build_mesh, degrees, resolve_strategy
from meshlm.runtime import Runtime, log

SUPPORTED = ("single", "dp", "ddp", "zero1") + FSDP_STRATEGIES + ("layer-split",)
PIPELINE_DP = ("ddp",) + FSDP_STRATEGIES  # what replicates or shards the stages of a pipeline


def plan_degrees(cfg: Config, world: int) -> tuple[str, Degrees]:
    """Strategy and degrees for `world` ranks, checked before any process or model exists."""
    strategy = resolve_strategy(cfg, world)
    if strategy not in SUPPORTED:
        raise MeshlmError(f"--strategy {strategy} is not available yet; supported: {', '.join(SUPPORTED)}")
    check_cpu_offload(cfg.cpu_offload, strategy, torch.cuda.is_available() and cfg.backend != "gloo")
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if strategy == "layer-split" and (tp > 1 or pp > 1):
        raise MeshlmError("--strategy layer-split places layers on --devices in one process; "
                          "it does not combine with --parallel.tp or --parallel.pp")
    d = degrees(cfg, world)
    if cfg.parallel.sequence_parallel and tp == 1:
        raise MeshlmError("--parallel.sequence-parallel needs --parallel.tp 2 or more")
    if cfg.parallel.sequence_parallel and cfg.seq_length % tp:
        raise MeshlmError(f"--parallel.sequence-parallel splits each sequence over tp = {tp} ranks; "
                          f"--seq-length {cfg.seq_length} is not a multiple of {tp}")
    if tp == pp == 1 and strategy != "layer-split":
        return strategy, d
    from meshlm.models.build import model_config

    mcfg = model_config(cfg)  # the config alone (no weights): heads, widths and layers to check against
    if strategy == "layer-split":
        from meshlm.parallel.layer_split import check_layer_split

        check_layer_split(cfg, mcfg)
    if tp > 1:
        from meshlm.parallel.tensor import check_tp

        check_tp(mcfg, tp)
        if d.dp > 1 and strategy not in FSDP_STRATEGIES:
            raise MeshlmError(f"tensor parallel with {d.dp} data-parallel ranks needs --strategy fsdp "
                              f"(DDP cannot hold tensor-parallel shards), not {strategy}")
    if pp > 1:
        if d.dp > 1 and strategy not in PIPELINE_DP:
            raise MeshlmError(f"pipeline parallel composes with --strategy {', '.join(PIPELINE_DP)} "
                              f"for its data-parallel ranks, not {strategy}")
        from meshlm.parallel.pipeline import check_pipeline

        check_pipeline(cfg, mcfg)
    return strategy, d


def build_device(cfg: Config, rt: Runtime) -> torch.device | str:
    """Where every rank builds the model: the meta device (shapes, no storage) in every layout.
    `parallelize` splits and shards it there, then gives this rank only its part (models/materialize.py)."""
    return "meta"


def parallelize(model, cfg: Config, rt: Runtime) -> Engine:
    strategy, d = plan_degrees(cfg, rt.world_size)
    # A model on the meta device gets its weights once this rank's part is known (`fill`), before any
    # wrapper that needs real tensors (DDP broadcasts them) and after FSDP, which shards on meta.
    init = InitialWeights.of(model, cfg.seed) if on_meta(model) else None
    fill = partial(_fill, model, init, cfg, rt)
    if strategy == "layer-split":
        from meshlm.parallel.layer_split import LayerSplitEngine

        _activation_checkpointing(model, cfg)  # blocks change in place, then move to their devices
        _compile(model, cfg)
        engine = LayerSplitEngine(model, cfg, rt)  # allocates each stage on its device
        fill()
        return engine
    mesh = build_mesh(rt.device.type, d) if rt.world_size > 1 else None
    sharded = strategy in FSDP_STRATEGIES
    if sharded and mesh is None:
        mesh = one_rank_mesh(rt.device)
    if d.pp > 1:
        return _pipeline(model, cfg, rt, mesh, strategy, fill)

    _tensor_parallel(model, cfg, mesh)  # 1.
    _activation_checkpointing(model, cfg)  # 2.
    _compile(model, cfg)  # 3.
    # 4. FSDP / DDP
    if sharded:
        engine = FSDPEngine(model, cfg, rt, mesh, strategy)
        fill()
        return engine
    fill()
    if strategy == "dp":
        from meshlm.parallel.dp import DataParallelEngine

        return DataParallelEngine(model, cfg, rt)
    if mesh is None or d.dp == 1:  # one rank, or tensor parallel alone: nothing to replicate
        return Engine(model, cfg, rt, mesh)
    if strategy == "ddp":
        from meshlm.parallel.ddp import DDPEngine

        return DDPEngine(model, cfg, rt, mesh)
    if strategy == "zero1":
        from meshlm.parallel.zero1 import ZeroOneEngine

        return ZeroOneEngine(model, cfg, rt, mesh)
    return Engine(model, cfg, rt, mesh)


def _fill(model, init: InitialWeights | None, cfg: Config, rt: Runtime) -> None:
    """This rank's weights (seeded init or --pretrained safetensors) for a model still on the meta device."""
    if init is not None:
        materialize(model, init, torch.device("cpu") if cfg.cpu_offload else rt.device,
                    cfg.model_name if cfg.pretrained else None)


def _pipeline(model, cfg: Config, rt: Runtime, mesh: Mesh, strategy: str, fill) -> Engine:
    """0. this rank's stages, then 1-4 on each stage."""
    from meshlm.models.parts import tied
    from meshlm.parallel.pipeline import PipelineEngine, split_for_rank

    model_tied = tied(model)
    stages = split_for_rank(model, cfg, mesh["pp"].get_local_rank())
    _tensor_parallel(model, cfg, mesh, runs=[s.layer_ids for s in stages])
    for s in stages:
        _activation_checkpointing(s, cfg)
        _compile(s, cfg)
    fsdp_stages = strategy in FSDP_STRATEGIES and mesh.degrees.dp > 1
    if not fsdp_stages:
        fill()
    modules = [_stage_data_parallel(s, cfg, strategy, mesh, rt) for s in stages]
    if fsdp_stages:
        fill()
    return PipelineEngine(model, stages, modules, cfg, rt, mesh, model_tied)


def _tensor_parallel(model, cfg: Config, mesh: Mesh | None, runs=None) -> None:
    if mesh is not None and mesh.degrees.tp > 1:
        from meshlm.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel, runs, sharded_logits=runs is None)


def _activation_checkpointing(model, cfg: Config) -> None:
    wrapped = apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if wrapped:
        log.info(f"activation checkpointing: {wrapped} of {len(transformer_blocks(model))} blocks "
                 f"recompute their activations in backward")


def _compile(model, cfg: Config) -> None:
    if cfg.compile:
        from meshlm.parallel.compiling import apply_compile

        log.info(f"compile: {apply_compile(model)} blocks compiled with torch.compile (the first step includes "
                 f"compiling them)")


def _stage_data_parallel(stage, cfg: Config, strategy: str, mesh: Mesh, rt: Runtime):
    """Replicate (DDP) or shard (FSDP) one pipeline stage over the data-parallel ranks; as is when there are none."""
    if mesh.degrees.dp == 1:
        return stage
    if strategy in FSDP_STRATEGIES:
        dp_mesh = mesh.world["dp_replicate", "dp_shard"] if strategy == "hsdp" else mesh.world["dp_shard"]
        # A stage runs forward on every micro-batch before their backwards: resharding after each
        # forward would all-gather the same parameters M times (torchtitan keeps them gathered too).
        return apply_fsdp(stage, dp_mesh, reshard_after_forward=False, offload=cfg.cpu_offload,
                          mp_policy=mixed_precision_policy(cfg.mixed_precision))
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DDP(stage, device_ids=device_ids, process_group=mesh["dp"].get_group())
