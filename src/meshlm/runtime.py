"""Process-group life cycle, device choice and rank helpers.

torchrun (or `meshlm train --nproc N`) sets RANK / LOCAL_RANK / WORLD_SIZE;
without them this is a single process and no process group is created.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import importlib
import logging
import os
import resource
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm import host_memory, rank0_wait
from meshlm.errors import MeshlmError, exit_status

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


@contextlib.contextmanager
def deterministic_on_cpu(device: torch.device):
    """Deterministic kernels while a CPU run trains (the same losses run after run: verify and the tests compare
    them); afterwards the process's own setting again (torch's switch is process-wide)."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def memory(device: torch.device) -> dict:
    """This process's memory on `device`: CUDA's allocator figures, or on the CPU the resident set and its peak."""
    if device.type == "cuda":
        return {
            "mem_allocated_bytes": torch.cuda.memory_allocated(device),
            "mem_reserved_bytes": torch.cuda.memory_reserved(device),
            "mem_peak_bytes": torch.cuda.max_memory_allocated(device),
        }
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"mem_rss_bytes": rss, "mem_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def backend_spec(backend: str, cuda: bool, cpu_collectives: bool) -> str:
    """The process group's backend string. NCCL moves only CUDA tensors; when state also lives on the CPU
    (--cpu-offload: offloaded gradients and their norm) every group
    also gets gloo, and torch picks the backend per collective from the tensor's device."""
    if backend == "nccl" and cuda and cpu_collectives:
        return "cuda:nccl,cpu:gloo"
    return backend


def init(
    backend: str = "auto", timeout_s: float = 600.0, want_cuda: bool | None = None, cpu_collectives: bool = False
) -> Runtime:
    """Pick the device and backend, and join the process group when there is more than one rank."""
    rank, local_rank, world, local_world = env_ranks()
    freeze_imports()
    cuda = torch.cuda.is_available() if want_cuda is None else want_cuda
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise MeshlmError("--backend nccl needs CUDA GPUs; none are visible (use --backend gloo)")
    if backend == "mpi" and not dist.is_mpi_available():
        raise MeshlmError("--backend mpi needs a PyTorch built with MPI; this one is not (use gloo or nccl)")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise MeshlmError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; lower --nproc")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        host_memory.return_freed_buffers()  # else glibc's heap keeps freed weight-sized buffers resident
    spec = backend_spec(backend, cuda, cpu_collectives)
    rt = Runtime(rank, local_rank, world, local_world, device, spec if world > 1 else "")
    if world > 1 and not dist.is_initialized():
        # device_id makes NCCL connect eagerly and lets DeviceMesh split its communicator (NCCL only);
        # with gloo beside it, sub-groups must be made with new_group, which copies both backends.
        kwargs = {"device_id": device} if device.type == "cuda" and spec == backend else {}
        dist.init_process_group(spec, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        global was_distributed, _rank0_bound_s
        was_distributed = True
        _rank0_bound_s = timeout_s
        rank0_wait.start_heartbeat(rank, local_rank)
    return rt


_frozen_in = 0  # the process whose objects freeze_imports froze


def freeze_imports() -> None:
    """Move what this process holds now (torch's and transformers' modules and classes: ~400k objects that live
    as long as it does) out of the garbage collector's view, once per process: a full collection (at shutdown,
    after generate, and every few thousand allocations) then costs milliseconds instead of 0.2-0.5 s of CPU, and
    a forked rank no longer copies the parent's pages by touching their objects' headers."""
    global _frozen_in
    if _frozen_in != os.getpid():
        gc.freeze()
        _frozen_in = os.getpid()


was_distributed = False  # this process ran a process group (cli.main then leaves with leave_rank)


def shutdown() -> None:
    """Join our own thread, free what holds the groups (DTensors' meshes, pending p2p works in reference
    cycles) while the interpreter is whole, then destroy every group: the order torch asks for."""
    rank0_wait.stop_heartbeat()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_rank(status: int) -> None:
    """End a rank's process that finished its work, skipping interpreter finalisation and C++ destructors.

    Why it stays (docs/errors.md, "Teardown"): after destroy_process_group a gloo backend object
    can outlive it through a Python reference torch itself keeps (a pending Work of an isend, a cached
    DeviceMesh); it is then destroyed during interpreter finalisation, where its worker thread is still
    joinable or its tensors need the GIL: "terminate called without an active exception", then SIGABRT or
    SIGSEGV, after everything was trained, saved and logged, and the launcher takes that for a failed rank.
    Seen twice among a few hundred gloo runs (interleaved pp, zero1); the same abort at exit
    is pytorch#190489, and torch's own fix (destroying groups from an atexit hook, pytorch#179291) was
    abandoned as more complicated than it looked. meshlm no longer leaves a thread of its own
    (the heartbeat is joined) and frees its objects before destroying the groups (shutdown), but what
    torch keeps is out of its reach, and a rate of 1 in ~150 cannot be shown gone on a CPU box in a
    session. Every sink is closed by then (Trainer.run, generate), so only the standard streams and
    logging handlers need flushing.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_flushed(status: int) -> None:
    """Leave a forked child at once (`os._exit`: never back into its parent's code nor its exit functions), its
    standard streams flushed where they are still open."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(status)


# How long a rank that lost its peer waits before leaving: torchelastic reports the one rank its poll (every 0.1 s)
# finds dead first, and a rank killed without an error file is named only if that is the killed one.
PEER_FIRST_S = 0.5
LAUNCHER_PID = "MESHLM_LAUNCHER_PID"  # set by launch._for_the_ranks: the process every rank dies with


def run_rank(target: str, *args) -> None:
    """What a rank forked by meshlm's launcher runs (launch.py): `target` ("module:function", imported here, so
    the launcher imports none of it) called with args, its errors shown as `meshlm` shows them. A training rank
    gets the launcher's Config: it parses nothing and imports none of the command line's modules.

    A rank that succeeds returns (torchelastic waits for every rank's return value); one that fails leaves with
    its status at once, as `python -m meshlm` would (leave_rank: no teardown that could still abort it)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    become_rank()
    from meshlm import rank_trace

    calls = rank_trace.start()
    module, name = target.split(":")
    try:
        status = exit_status(record(getattr(importlib.import_module(module), name)), *args)
    except Exception as e:
        from meshlm.launch_failures import COLLATERAL

        if COLLATERAL.search(str(e)):  # a peer died under this rank: the launcher must see that death first
            time.sleep(PEER_FIRST_S)
        raise
    rank_trace.write(calls)
    if status:
        leave_rank(status)


def become_rank() -> None:
    """The first thing a rank forked by launch() does: a session of its own, as torchrun's rank processes have,
    so a terminal's Ctrl-C reaches the launcher only (which passes it on once); and death with the launcher."""
    die_with_launcher(int(os.environ[LAUNCHER_PID]))
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked in the fork server it came from
    # Forked from the launcher itself (launch.start_method): its handlers and its threads, set when torch was
    # imported there, are not a rank's
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))


def die_with_launcher(launcher: int) -> None:
    """In a rank started by meshlm's launcher: be killed when the launcher dies, however it dies (SIGKILL by
    the OOM killer, a closed terminal), so no rank goes on training into a run directory nobody holds.

    Each rank runs in a session of its own (become_rank), so nothing else reaches it, and its parent is the
    launcher's fork server, which lives as long as any rank holds its pipe: a daemon thread waits on the
    launcher's pidfd instead (Linux 5.3 and later; elsewhere a rank outlives a killed launcher)."""
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:  # the launcher died before the watch began
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return

    def watch():
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="meshlm-launcher-watch", daemon=True).start()


# train/faults.py's variables (testing aids): a rank imports that module only when one of them is set
FAULT_VARIABLES = (
    "MESHLM_FAIL_AT_STEP",
    "MESHLM_STALL_AT_STEP",
    "MESHLM_STEP_SLEEP",
    "MESHLM_NONFINITE_STEPS",
    "MESHLM_PAUSE_IN_SAVE",
    "MESHLM_FAIL_IN_LOAD",
)


def injected_faults():
    """train/faults.py when a variable asks a rank to misbehave, else None: a run that asks for no fault never
    loads it."""
    if any(os.environ.get(name) for name in FAULT_VARIABLES):
        return importlib.import_module("meshlm.train.faults")
    return None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def agree_on_error(error: str | None) -> None:
    """Raise the same one-line error on every rank when any rank has one (each rank calls this at the same
    point), so none of them waits in the next collective for a rank that left."""
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise MeshlmError(first)


_rank0_bound_s = 600.0  # how long a silent rank 0 may stay silent (--dist-timeout), set by init


@contextlib.contextmanager
def rank0_first(local: bool = False, what: str = "its rank-0-first work"):
    """Rank 0 runs the block first (download, tokenise into a cache); the others follow once it is done.

    With local=True the first rank of every node goes first, for caches on node-local disks. The others
    do not wait in a collective (bounded by --dist-timeout, which a real corpus outlasts): they wait on
    the store for as long as rank 0 is alive (rank0_wait.py), and fail at once if its block raised.
    """
    if not dist.is_initialized() or dist.get_backend() == "fake":  # `plan --simulate` runs one rank alone
        yield
        return
    rank = dist.get_rank()
    leader = rank - int(os.environ.get("LOCAL_RANK", 0)) if local else 0
    key = rank0_wait.next_key(leader)
    if rank != leader:
        rank0_wait.wait_for(key, leader, what, _rank0_bound_s)
        yield
        return
    with rank0_wait.announce(key):
        yield


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
    """Only rank 0 prints to the console; attach_log_file adds logs/rank-N.log once the run is accepted.
    A record logged with extra={"console": False} goes to the log file only."""
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    if rt.is_main:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(logging.Formatter("%(message)s"))
        sh.addFilter(lambda record: getattr(record, "console", True))
        log.addHandler(sh)


def attach_log_file(rt: Runtime, log_dir: Path) -> None:
    fh = logging.FileHandler(log_dir / f"rank-{rt.rank}.log")
    fh.setFormatter(logging.Formatter(f"%(asctime)s [rank {rt.rank}] %(levelname)s %(message)s"))
    log.addHandler(fh)
    dump_stacks_on_signal(log_dir / f"rank-{rt.rank}.log")


_stack_file = None  # faulthandler writes to its file descriptor at signal time, so it stays open


def dump_stacks_on_signal(path: Path | None = None) -> None:
    """On SIGTERM (the launcher stopping the job after another rank failed or timed out) and on fatal
    signals, write every thread's Python stack to `path` (the rank's log) or stderr, then die as before.

    faulthandler does this from the C signal handler, so it works while the main thread is blocked
    inside a collective, where a Python signal handler would never run.
    """
    global _stack_file
    f = open(path, "a") if path else sys.__stderr__  # faulthandler needs a real file descriptor
    faulthandler.enable(file=f, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=f, all_threads=True, chain=True)
    if _stack_file is not None and _stack_file is not sys.__stderr__:
        _stack_file.close()
    _stack_file = f


def log_exception() -> None:
    """Append the exception being handled to this rank's log; the console shows it once, from the launcher."""
    if _stack_file is not None and _stack_file is not sys.__stderr__:
        _stack_file.write(traceback.format_exc())
        _stack_file.flush()


def largest_over_ranks(value: int, rt: Runtime) -> int:
    if rt.world_size == 1:
        return value
    t = torch.tensor(value, device=rt.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())
