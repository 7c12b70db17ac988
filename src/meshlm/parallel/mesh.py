"""Turn the parallel degrees into one DeviceMesh with named dimensions (layout.py decides and checks them).

Dimensions, outermost first: pp, dp_replicate, dp_shard, tp. Tensor parallel is
innermost so its frequent all-reduces stay between neighbouring ranks (one node);
pipeline parallel is outermost because its point-to-point traffic is the
lightest and tolerates slow inter-node links.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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
        world = init_device_mesh(
            device_type,
            (d.pp, d.dp_replicate, d.dp_shard, d.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )
        return Mesh(world, world["dp_replicate", "dp_shard"]._flatten("dp"), d)


def one_rank_mesh(device: torch.device) -> Mesh:
    """FSDP on a single rank shards nothing, but its CPU offload and bf16 policy still apply: the way to
    fit a model that needs offloading on one GPU. FSDP needs a process group, so make a 1-rank one."""
    if not dist.is_initialized():
        # gloo beside NCCL: offloaded gradients (and their norm) are CPU tensors (runtime.backend_spec)
        dist.init_process_group(
            "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    return build_mesh(device.type, Degrees())
