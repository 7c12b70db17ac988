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

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.parallel.engine import Engine
from meshlm.parallel.mesh import Degrees, build_mesh, degrees, resolve_strategy
from meshlm.runtime import Runtime

SUPPORTED = ("single", "dp", "ddp")


def plan_degrees(cfg: Config, world: int) -> tuple[str, Degrees]:
    """Strategy and degrees for `world` ranks, checked before any process or model exists."""
    strategy = resolve_strategy(cfg, world)
    if strategy not in SUPPORTED:
        raise MeshlmError(f"--strategy {strategy} is not available yet; supported: {', '.join(SUPPORTED)}")
    return strategy, degrees(cfg, world)


def parallelize(model, cfg: Config, rt: Runtime) -> Engine:
    strategy, d = plan_degrees(cfg, rt.world_size)
    mesh = build_mesh(rt.device.type, d) if rt.world_size > 1 else None
    if strategy == "dp":
        from meshlm.parallel.dp import DataParallelEngine

        return DataParallelEngine(model, cfg, rt)
    if strategy == "ddp" and mesh is not None:
        from meshlm.parallel.ddp import DDPEngine

        return DDPEngine(model, cfg, rt, mesh)
    return Engine(model, cfg, rt, mesh)
