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

from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.parallel.engine import Engine
from meshlm.parallel.fsdp import FSDP_STRATEGIES, apply_fsdp, mixed_precision_policy
from meshlm.parallel.mesh import Degrees, Mesh, build_mesh, degrees, resolve_strategy
from meshlm.runtime import Runtime

SUPPORTED = ("single", "dp", "ddp", "fsdp", "layer-split")
PIPELINE_DP = ("ddp", "fsdp")  # what replicates or shards the stages of a pipeline


def plan_degrees(cfg: Config, world: int) -> tuple[str, Degrees]:
    """Strategy and degrees for `world` ranks, checked before any process or model exists."""
    strategy = resolve_strategy(cfg, world)
    if strategy not in SUPPORTED:
        raise MeshlmError(f"--strategy {strategy} is not available yet; supported: {', '.join(SUPPORTED)}")
    d = degrees(cfg, world)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if tp == pp == 1 and strategy != "layer-split":
        return strategy, d
    from meshlm.models.build import model_config

    mcfg = model_config(cfg)  # the config alone (no weights): heads, widths and layers to check against
    if strategy == "layer-split":
        if tp > 1 or pp > 1:
            raise MeshlmError("--strategy layer-split places layers on --devices in one process; "
                              "it does not combine with --parallel.tp or --parallel.pp")
        from meshlm.parallel.layer_split import check_layer_split

        check_layer_split(cfg, mcfg)
    if tp > 1:
        from meshlm.parallel.tensor import check_tp

        check_tp(mcfg, tp)
    if tp > 1 and d.dp > 1 and strategy not in FSDP_STRATEGIES:
        raise MeshlmError(f"tensor parallel with {d.dp} data-parallel ranks needs --strategy fsdp "
                          f"(DDP cannot hold tensor-parallel shards), not {strategy}")
    if cfg.parallel.sequence_parallel and tp == 1:
        raise MeshlmError("--parallel.sequence-parallel needs --parallel.tp 2 or more")
    if pp > 1:
        if d.dp > 1 and strategy not in PIPELINE_DP:
            raise MeshlmError(f"pipeline parallel composes with --strategy {' or '.join(PIPELINE_DP)} "
                              f"for its data-parallel ranks, not {strategy}")
        from meshlm.parallel.pipeline import check_pipeline

        check_pipeline(cfg, mcfg)
    return strategy, d


def parallelize(model, cfg: Config, rt: Runtime) -> Engine:
    strategy, d = plan_degrees(cfg, rt.world_size)
    if strategy == "layer-split":
        from meshlm.parallel.layer_split import LayerSplitEngine

        return LayerSplitEngine(model, cfg, rt)
    if strategy == "dp":
        from meshlm.parallel.dp import DataParallelEngine

        return DataParallelEngine(model, cfg, rt)
    if rt.world_size == 1:
        return Engine(model, cfg, rt)
    mesh = build_mesh(rt.device.type, d)

    if d.pp > 1:  # 0. this rank's stages, then 1-4 on each stage
        from meshlm.models.parts import tied
        from meshlm.parallel.pipeline import PipelineEngine, split_for_rank

        model_tied = tied(model)
        stages = split_for_rank(model, cfg, mesh["pp"].get_local_rank())
        _tensor_parallel(model, cfg, mesh, runs=[s.layer_ids for s in stages])
        modules = [_data_parallel(s, cfg, strategy, mesh, rt, pipelined=True) for s in stages]
        return PipelineEngine(model, stages, modules, cfg, rt, mesh, model_tied)

    _tensor_parallel(model, cfg, mesh)  # 1.
    if d.dp == 1:  # tensor parallel alone: nothing to replicate
        return Engine(model, cfg, rt, mesh)
    if strategy in FSDP_STRATEGIES:  # 4.
        from meshlm.parallel.fsdp import FSDPEngine

        return FSDPEngine(model, cfg, rt, mesh, strategy)
    from meshlm.parallel.ddp import DDPEngine

    return DDPEngine(model, cfg, rt, mesh)


def _tensor_parallel(model, cfg: Config, mesh: Mesh, runs=None) -> None:
    if mesh.degrees.tp > 1:
        from meshlm.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel, runs)


def _data_parallel(module, cfg: Config, strategy: str, mesh: Mesh, rt: Runtime, pipelined: bool = False):
    """Replicate (DDP) or shard (FSDP) one module over the data-parallel ranks; as is when there are none."""
    if mesh.degrees.dp == 1:
        return module
    if strategy in FSDP_STRATEGIES:
        dp_mesh = mesh.world["dp_replicate", "dp_shard"] if strategy == "hsdp" else mesh.world["dp_shard"]
        # A pipeline stage runs forward on every micro-batch before their backwards: resharding after each
        # forward would all-gather the same parameters M times (torchtitan keeps them gathered too).
        return apply_fsdp(module, dp_mesh, reshard_after_forward=not pipelined and strategy != "zero2",
                          mp_policy=mixed_precision_policy(cfg.mixed_precision))
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, process_group=mesh["dp"].get_group())
