"""Apply the parallel techniques to a model in one fixed order, each a function that takes a module
and returns it.

Order matters and is the same everywhere (as in torchtitan):
  0. pipeline split    - keeps this rank's stages and drops the rest of the model
  1. tensor parallel   - rewrites Linear weights into DTensor shards; must see the plain model
  2. activation ckpt   - wraps whole blocks, so it goes after TP changed their insides
  3. compile           - compiles the wrapped blocks
  4. data parallel     - outermost: FSDP shards or DDP replicates whatever the blocks now are
Under a pipeline, steps 1-4 apply to each stage, which is then a model of its own. All of it
happens on the layout's DeviceMesh (pp, dp_replicate, dp_shard, tp); the engine that comes out
only steps (accumulation, clipping, the optimizer, metrics).
"""

from __future__ import annotations

import torch

from meshlm.config import Config
from meshlm.layout import Layout
from meshlm.models.blocks import transformer_blocks
from meshlm.models.meta_init import materialize
from meshlm.parallel import lora
from meshlm.parallel.checkpointing import apply_activation_checkpointing
from meshlm.parallel.engine import Engine
from meshlm.parallel.fsdp import FSDPEngine, apply_fsdp, mixed_precision_policy
from meshlm.parallel.master_weights import MasterWeightEngine, uses_master_weights
from meshlm.parallel.mesh import Mesh
from meshlm.runtime import Runtime, log, wait_for_rank0


def build_device(cfg: Config, layout: Layout, rt: Runtime) -> torch.device | str:
    """Where this rank builds the model. Sharded layouts on more than one rank: rank 0 on the CPU (its
    full copy, random or pretrained, never needs the accelerator) and the others on the meta device,
    shapes only; after sharding each rank gets its part of rank 0's weights (models/meta_init.py).
    Not under tensor or pipeline parallel: TP splits rank 0's weights as it shards them, and a
    pipeline rank keeps only its stages, so every rank builds (and then drops most of) the model."""
    if _on_meta(cfg, layout):
        return "cpu" if rt.is_main else "meta"
    return rt.device


def _on_meta(cfg: Config, layout: Layout) -> bool:
    """FSDP alone on several ranks, where each rank keeps only shards (bf16 zero1/zero2 keep whole working copies)."""
    return (layout.world > 1 and layout.sharded and not (layout.tp_enabled or layout.pp_enabled)
            and not uses_master_weights(cfg, layout.strategy, layout.world))


def parallelize(model, cfg: Config, rt: Runtime, layout: Layout) -> Engine:
    wait_for_rank0("loading the model")  # rank 0 built or loaded the weights it broadcasts: no timeout on that
    lora.apply_lora(model, cfg)  # adapters first: every technique below then treats them as parts of their blocks
    if layout.strategy == "layer-split":
        from meshlm.parallel.layer_split import LayerSplitEngine

        # blocks change in place, then move to their devices
        return LayerSplitEngine(compile_blocks(activation_checkpointing(model, cfg), cfg), cfg, rt)
    mesh = layout.mesh(rt.device.type)
    if uses_master_weights(cfg, layout.strategy, layout.world):  # bf16 zero1/zero2: fp32 masters sharded by owner
        model = compile_blocks(activation_checkpointing(model, cfg), cfg)
        return MasterWeightEngine(model, cfg, rt, mesh, layout.strategy)
    if layout.pp_enabled:
        return _pipeline(model, cfg, rt, layout, mesh)

    # rank 0's real weights, taken before anything rewrites the parameters (ranks > 0 are on meta)
    full_state = model.state_dict() if _on_meta(cfg, layout) and rt.is_main else None
    model = tensor_parallel(model, cfg, mesh)  # 1.
    model = activation_checkpointing(model, cfg)  # 2.
    model = compile_blocks(model, cfg)  # 3.
    if layout.strategy == "dp":  # single-process nn.DataParallel: its own wrap, on every step
        from meshlm.parallel.dp import DataParallelEngine

        return DataParallelEngine(model, cfg, rt)
    wrapped = data_parallel(model, cfg, rt, layout, mesh)  # 4.
    if layout.sharded:
        engine = FSDPEngine(wrapped, cfg, rt, mesh, layout.strategy)
        if _on_meta(cfg, layout):
            materialize(model, full_state, torch.device("cpu") if cfg.cpu_offload else rt.device)
        return engine
    if not layout.replicated:  # one rank, or tensor parallel alone: nothing to replicate
        return Engine(wrapped, cfg, rt, mesh)
    if layout.strategy == "zero1":
        from meshlm.parallel.zero1 import ZeroOneEngine

        return ZeroOneEngine(wrapped, cfg, rt, mesh)
    from meshlm.parallel.ddp import DDPEngine

    return DDPEngine(wrapped, cfg, rt, mesh)


def _pipeline(model, cfg: Config, rt: Runtime, layout: Layout, mesh: Mesh) -> Engine:
    """0. this rank's stages, then 1-4 on each stage."""
    from meshlm.models.parts import tied
    from meshlm.parallel.pipeline import PipelineEngine, split_for_rank

    model_tied = tied(model)
    stages = split_for_rank(model, cfg, mesh["pp"].get_local_rank())
    tensor_parallel(model, cfg, mesh, runs=[s.layer_ids for s in stages])
    stages = [compile_blocks(activation_checkpointing(s, cfg), cfg) for s in stages]
    modules = [data_parallel(s, cfg, rt, layout, mesh, pipeline_stage=True) for s in stages]
    return PipelineEngine(model, stages, modules, cfg, rt, mesh, model_tied)


def tensor_parallel(model, cfg: Config, mesh: Mesh | None, runs=None):
    if mesh is not None and mesh.degrees.tp > 1:
        from meshlm.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel, runs)
    return model


def activation_checkpointing(model, cfg: Config):
    wrapped = apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if wrapped:
        log.info(f"activation checkpointing: {wrapped} of {len(transformer_blocks(model))} blocks "
                 f"recompute their activations in backward")
    return model


def compile_blocks(model, cfg: Config):
    if cfg.compile:
        from meshlm.parallel.compiling import apply_compile

        log.info(f"compile: {apply_compile(model)} blocks compiled with torch.compile (the first step includes "
                 f"compiling them)")
    return model


def data_parallel(module, cfg: Config, rt: Runtime, layout: Layout, mesh: Mesh | None, pipeline_stage: bool = False):
    """The one data-parallel wrap, for the whole model and for each pipeline stage: FSDP shards it over the
    data-parallel part of the mesh (also on one rank, where only offload and the bf16 policy act), DDP
    replicates it; as is when there is nothing to replicate."""
    if mesh is None or (pipeline_stage and not layout.dp_enabled):
        return module
    if layout.sharded:
        dp_mesh = mesh.world["dp_replicate", "dp_shard"] if layout.strategy == "hsdp" else mesh.world["dp_shard"]
        # zero2 keeps gathered parameters from forward to backward. So does a pipeline stage: it runs forward
        # on every micro-batch before their backwards, and resharding after each forward would all-gather
        # the same parameters M times (torchtitan keeps them gathered too).
        reshard = layout.strategy != "zero2" and not pipeline_stage
        return apply_fsdp(module, dp_mesh, reshard_after_forward=reshard, offload=cfg.cpu_offload,
                          mp_policy=mixed_precision_policy(cfg.mixed_precision))
    if layout.replicated:
        from meshlm.parallel.ddp import replicate

        return replicate(module, cfg.sync_batchnorm, rt.device, mesh["dp"].get_group())
    return module
