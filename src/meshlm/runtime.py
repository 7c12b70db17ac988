"""Process-group life cycle, device choice and rank helpers.

torchrun (or `meshlm train --nproc N`) sets RANK / LOCAL_RANK / WORLD_SIZE;
without them this is a single process and no process group is created.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.errors import MeshlmError

log = logging.getLogger("meshlm")


@dataclass
class Runtime:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = ""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_ranks() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's environment."""
    try:
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError as e:
        raise MeshlmError(f"RANK/LOCAL_RANK/WORLD_SIZE must be integers: {e}") from None
    return rank, local_rank, world, local_world


def init(backend: str = "auto", timeout_s: float = 600.0, want_cuda: bool | None = None) -> Runtime:
    """Pick the device and backend, and join the process group when there is more than one rank."""
    rank, local_rank, world, local_world = env_ranks()
    cuda = torch.cuda.is_available() if want_cuda is None else want_cuda
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise MeshlmError("--backend nccl needs CUDA GPUs; none are visible (use --backend gloo)")
    if backend == "mpi" and not dist.is_mpi_available():
        raise MeshlmError("--backend mpi needs a PyTorch built with MPI; this one is not (use gloo or nccl)")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise MeshlmError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; lower --nproc"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    rt = Runtime(rank, local_rank, world, local_world, device, backend if world > 1 else "")
    if world > 1 and not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return rt


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def rank0_first(local: bool = False):
    """Rank 0 runs the block first (download, tokenise into a cache); the others follow after a barrier.

    With local=True the first rank of every node goes first, for caches on node-local disks.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if local:
        rank = int(os.environ.get("LOCAL_RANK", rank))
    if rank != 0:
        barrier()
    yield
    if rank == 0:
        barrier()


def make_run_dir(path: Path) -> Path:
    """Create the output directory on rank 0 with every rank waiting on both sides.

    Shared file systems differ in when a new directory becomes visible; the
    barriers make "exists" mean the same thing on every rank.
    """
    barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        (path / "checkpoints").mkdir(exist_ok=True)
    barrier()
    (path / "logs").mkdir(parents=True, exist_ok=True)  # a node-local file system on other nodes
    return path


def setup_logging(rt: Runtime) -> None:
    """Only rank 0 prints to the console; attach_log_file adds logs/rank-N.log once the run is accepted."""
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    if rt.is_main:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(sh)


def attach_log_file(rt: Runtime, log_dir: Path) -> None:
    fh = logging.FileHandler(log_dir / f"rank-{rt.rank}.log")
    fh.setFormatter(logging.Formatter(f"%(asctime)s [rank {rt.rank}] %(levelname)s %(message)s"))
    log.addHandler(fh)
