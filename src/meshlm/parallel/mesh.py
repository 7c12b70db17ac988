"""Turn the parallel degrees into one DeviceMesh with named dimensions, and check them.

Dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallel is
innermost so its frequent all-reduces stay between neighbouring ranks (one node);
pipeline parallel is outermost because its point-to-point traffic is the
lightest and tolerates slow inter-node links.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshlm.config import Config
from meshlm.errors import MeshlmError

SHARDED = ("zero2", "zero3", "fsdp")


@dataclass(frozen=True)
class Degrees:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


def resolve_strategy(cfg: Config, world: int) -> str:
    if cfg.strategy != "auto":
        return cfg.strategy
    if world == 1:
        return "single"
    # Tensor-parallel shards are DTensors, which FSDP shards further (2-D) and DDP cannot hold.
    dp = world // (cfg.parallel.tp * cfg.parallel.pp)
    return "fsdp" if cfg.parallel.tp > 1 and dp > 1 else "ddp"


def degrees(cfg: Config, world: int) -> Degrees:
    """The degrees of every mesh dimension for `world` ranks, or a one-line error saying what does not fit."""
    strategy = resolve_strategy(cfg, world)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if strategy in ("single", "dp", "layer-split") and world > 1:
        raise MeshlmError(f"--strategy {strategy} runs in one process; drop --nproc {world} or pick ddp/fsdp")
    if world % (tp * pp):
        raise MeshlmError(f"world size {world} is not divisible by tp x pp = {tp} x {pp}; "
                          f"use a rank count that is a multiple of {tp * pp}")
    dp = world // (tp * pp)
    if strategy == "hsdp":
        shard = cfg.parallel.shard_size or dp
        if dp % shard:
            raise MeshlmError(f"--parallel.shard-size {shard} does not divide the {dp} data-parallel ranks; "
                              f"pick a divisor of {dp}")
        return Degrees(pp, dp // shard, shard, tp)
    if strategy in SHARDED:
        return Degrees(pp, 1, dp, tp)
    return Degrees(pp, dp, 1, tp)


@dataclass(frozen=True)
class Mesh:
    """The 4-D mesh (size-1 dimensions included) and its flattened data-parallel dimension."""

    world: DeviceMesh
    dp: DeviceMesh
    degrees: Degrees

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.dp if name == "dp" else self.world[name]


def build_mesh(device_type: str, d: Degrees) -> Mesh:
    # The mesh's rank table is a real tensor even when `meshlm plan --simulate` runs the layout on fake ones.
    with unset_fake_temporarily():
        world = init_device_mesh(device_type, (d.pp, d.dp_replicate, d.dp_shard, d.tp),
                                 mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        return Mesh(world, world["dp_replicate", "dp_shard"]._flatten("dp"), d)
