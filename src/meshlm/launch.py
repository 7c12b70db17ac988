"""Start local ranks through torchrun's own launcher API (torch.distributed.launcher).

One launcher per node: standalone (a c10d rendezvous on 127.0.0.1, free port)
for one node, or c10d on the endpoint given for many; either way every socket
listens on one address only (rendezvous.py). Each rank's stderr and
torchelastic error file go to files; the console shows rank 0's progress and,
when ranks fail, the root-cause rank's error once, with where the other ranks
were stuck when the failure was a timeout (launch_failures.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshlm import compat, launch_failures, rendezvous
from meshlm.errors import MeshlmError, interrupted
from meshlm.runtime import LAUNCHER_PID, run_rank


@dataclass
class LaunchOptions:
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    max_restarts: int = 0
    omp_threads: int = 0  # 0: cores / local ranks, at least 1
    rdzv_timeout: int = 600  # seconds for every node to join the rendezvous (torch's join_timeout)


def run_id(opts: LaunchOptions, port: int) -> str:
    """The rendezvous id. Every node's launcher must use the same one, so with several nodes and no
    --rdzv-id it comes from what they already share: the endpoint's port (its host may be written
    differently on each node). One node: a fresh id per run (its store is private anyway)."""
    if opts.rdzv_id:
        return opts.rdzv_id
    return f"meshlm-{port}" if opts.nnodes > 1 else f"meshlm-{uuid.uuid4().hex[:8]}"


def check(opts: LaunchOptions) -> tuple[str, int]:
    """Validate the launch flags; returns the rendezvous (host, port)."""
    if opts.nproc < 1:
        raise MeshlmError(f"--nproc must be at least 1, got {opts.nproc} (leave it out to run in this process)")
    if opts.nnodes < 1:
        raise MeshlmError(f"--nnodes must be at least 1, got {opts.nnodes}")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise MeshlmError(f"--node-rank {opts.node_rank} is outside 0..{opts.nnodes - 1} for --nnodes {opts.nnodes}")
    if opts.max_restarts < 0 or opts.omp_threads < 0:
        raise MeshlmError("--max-restarts and --omp-threads must not be negative")
    if opts.rdzv_timeout < 1:
        raise MeshlmError(f"--rdzv-timeout must be at least 1 second, got {opts.rdzv_timeout}")
    if not opts.rdzv_endpoint:
        if opts.nnodes > 1:
            raise MeshlmError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the address of the node with --node-rank 0)"
            )
        return "127.0.0.1", 0  # standalone: loopback only, a free port
    host, _, port = opts.rdzv_endpoint.rpartition(":")
    host = host.strip("[]")  # [::1]:29400
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MeshlmError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {opts.rdzv_endpoint!r}")
    return host, int(port)


class RankFiles(LogsSpecs):
    """stderr and error file of global rank N at <dir>/rank-N.stderr and rank-N.error.json; stdout stays on the
    console."""

    def __init__(self, log_dir: str):
        super().__init__(log_dir=log_dir)
        self._dir = log_dir

    @property
    def root_log_dir(self) -> str:
        return self._dir

    def reify(self, envs):
        dest = LogsDest(stdouts={}, stderrs={}, tee_stdouts={}, tee_stderrs={}, error_files={})
        for local_rank, env in envs.items():
            rank = env.get("RANK", str(local_rank))
            dest.stdouts[local_rank] = ""  # console
            dest.stderrs[local_rank] = os.path.join(self._dir, f"rank-{rank}.stderr")
            dest.error_files[local_rank] = os.path.join(self._dir, f"rank-{rank}.error.json")
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
        return dest


class _RestartNotice(logging.Handler):
    """torchelastic's own log goes to a file; only its decision to restart is worth a console line."""

    def emit(self, record):
        if "will restart worker group" in record.msg and "attempts left" in record.msg:
            _, _, left, most = record.args
            print(
                f"meshlm: a rank failed; restarting all ranks from checkpoints/latest "
                f"(restart {most - left + 1} of {most})",
                file=sys.stderr,
                flush=True,
            )


SPAWN_LOGGER = "torch.multiprocessing.spawn"


def _quiet_torchelastic(log_file: Path) -> None:
    """torchelastic's own log goes to a file while the job runs; only its decision to restart reaches the console.
    So does torch.multiprocessing's (it says which ranks it stops after one failed)."""
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.propagate = False
    elastic.handlers = [logging.FileHandler(log_file, delay=True), _RestartNotice()]
    spawn = logging.getLogger(SPAWN_LOGGER)
    spawn.propagate, spawn.handlers = False, [elastic.handlers[0]]
    for name in list(logging.root.manager.loggerDict):  # torch sets each module's logger to WARNING
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.INFO)


def threads_per_rank(nproc: int) -> int:
    """OMP_NUM_THREADS of a local rank unless --omp-threads says: the cores shared out, at least one each."""
    return max(1, (os.cpu_count() or 1) // nproc)


def launch(
    target: str,
    args: tuple,
    opts: LaunchOptions,
    out_dir: Path | None,
    stop_timeout_s: float = 30,
) -> int:
    """Run `target` ("module:function") with `args` on opts.nproc local ranks, each through runtime.run_rank;
    returns the exit status.

    out_dir is where the ranks' logs/ go (a run directory); None for commands without one (generate).
    The ranks' stderr and error files are written to a temporary directory and moved next to the rank logs
    only when this job opened the run directory; bad input (a MeshlmError on any rank) leaves it as it was.
    stop_timeout_s: how long the ranks may take to stop (and save) after a SIGINT/SIGTERM, then SIGKILL.
    """
    host, port = check(opts)
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-launch-"))
    threads = opts.omp_threads or threads_per_rank(opts.nproc)
    rendezvous.register()
    rid = run_id(opts, port)
    before = launch_failures.rank_log_sizes(out_dir)
    status, keep_tmp = 1, False
    try:
        with _for_the_ranks(threads, tmp / f"launcher-node-{opts.node_rank}.log"):
            try:
                config = _config(opts, rid, host, port, tmp, stop_timeout_s)
                if config.start_method == "forkserver":
                    _start_fork_server()
                elastic_launch(config, entrypoint=run_rank)(target, *args)
                status = 0
            except ChildFailedError as e:
                status, keep_tmp = launch_failures.failed(e.failures, tmp, out_dir, before)
            except SignalException as e:  # torchelastic sent SIGINT on to the ranks and waited for them
                received = _received_signal or e.sigval
                print(f"meshlm: {interrupted(received, out_dir)}", file=sys.stderr)
                status = 128 + received
            except (RendezvousError, OSError, DistError) as e:
                raise MeshlmError(_rendezvous_failure(e, opts, rid, host, port)) from None
        if status in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM) and launch_failures.opened(out_dir, before):
            launch_failures.move_files(tmp, out_dir / "logs")
    finally:
        compat.stop_fork_server()
        if not keep_tmp:  # a temporary directory stays only when the failure report names its files
            shutil.rmtree(tmp, ignore_errors=True)
    return status


def _config(opts: LaunchOptions, rid: str, host: str, port: int, tmp: Path, stop_timeout_s: float) -> LaunchConfig:
    local_addr = "127.0.0.1" if not opts.rdzv_endpoint else rendezvous.local_address(host, port)
    rendezvous.pin_gloo(local_addr)
    return compat.launch_config(
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=opts.nproc,
        run_id=rid,
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        rdzv_configs={"is_host": opts.node_rank == 0, "node_rank": opts.node_rank, "join_timeout": opts.rdzv_timeout},
        max_restarts=opts.max_restarts,
        monitor_interval=0.1,
        start_method=start_method(),
        logs_specs=RankFiles(str(tmp)),
        local_addr=local_addr,
        shutdown_timeout=max(1, math.ceil(stop_timeout_s)),
        signals_to_handle=",".join(s.name for s in PASSED_ON),  # SIGTERM: _stop_gracefully
    )


# What every rank imports before it does anything (~5 s of CPU: torch, then transformers' modeling_utils, which
# pulls torch._dynamo, DTensor and its quantizers): the fork server imports it once per launch and forks the
# ranks from there, where each rank started as `python -m meshlm` used to import it again.
RANK_IMPORTS = ["meshlm.train.trainer"]  # meshlm first: its __init__ filters what torchao logs at import


def start_method() -> str:
    """How the ranks start: forked from this process when it has imported RANK_IMPORTS already, runs one thread
    and writes to its own standard streams (verify's runs, tests: nothing to import again, no thread whose locks
    a fork would copy held), else from a fork server that imports them once (the command line's launcher has
    not: it starts the ranks while that runs). Not where CUDA devices are: see _start_fork_server."""
    ready = all(m in sys.modules for m in RANK_IMPORTS) and threading.active_count() == 1 and _own_streams()
    return "fork" if ready and not torch.cuda.is_available() else "forkserver"


def _own_streams() -> bool:
    """sys.stdout and sys.stderr are this process's fd 1 and 2, which torchelastic redirects to a rank's files
    (not a notebook's or a test's capture, which a forked rank would inherit)."""
    try:
        return sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError
        return False


def _start_fork_server() -> None:
    """Start the fork server the ranks are forked from, with the environment the ranks inherit (_for_the_ranks:
    OMP_NUM_THREADS must be set before it imports torch), so that it imports RANK_IMPORTS while the rendezvous
    runs. launch() stops it when its ranks are done. Where CUDA devices are, it imports nothing: a library that
    asks CUDA for its devices at import initialises the driver, which a forked rank cannot use (torch's
    is_available, unless PYTORCH_NVML_BASED_CUDA_CHECK is set), so there each rank imports for itself."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([] if torch.cuda.is_available() else RANK_IMPORTS)
    # A terminal's Ctrl-C reaches the launcher's whole process group, and the server ignores SIGINT only once
    # its imports are done: before that it died of it with a KeyboardInterrupt traceback on the console. It is
    # born with SIGINT blocked (the mask survives exec; CPython starts its resource tracker so, bpo-33613), the
    # launcher gets one sent meanwhile when it unblocks it, and each rank unblocks it for itself
    # (runtime.become_rank).
    # The resource tracker first: starting it unblocks SIGINT in this thread whatever the mask was.
    multiprocessing.resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# Signals torchelastic passes on to the ranks as they are. SIGTERM is not among them: the launcher sends it
# itself to stop the ranks of a failed job, which must die at once (dumping their stacks, runtime.py), so a
# SIGTERM this launcher receives (kill, a preempted job) goes on as SIGINT, which ranks take as "stop after this
# step" (train/stopping.py).
PASSED_ON = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_received_signal = 0


def _stop_gracefully(signum, frame):
    global _received_signal
    _received_signal = signum
    raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum).name}", sigval=signal.SIGINT)


# what the ranks inherit from here (GLOO_SOCKET_IFNAME: rendezvous.pin_gloo; the signals: torchelastic)
RANK_ENVIRONMENT = (
    "OMP_NUM_THREADS",
    "MESHLM_LAUNCHED",
    LAUNCHER_PID,
    "GLOO_SOCKET_IFNAME",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
)


@contextlib.contextmanager
def _for_the_ranks(threads: int, log_file: Path):
    """The environment the ranks inherit (their OpenMP threads, that meshlm launched them and which process they
    die with, rendezvous.pin_gloo's interface), the launcher's signal handlers (SIGTERM stops the ranks after a
    step; torchelastic installs its own) and torchelastic's logging into `log_file`, for as long as the ranks
    run; afterwards this process has its own back (a program that calls launch() keeps its environment, its
    handlers and its loggers)."""
    global _received_signal
    saved_env = {k: os.environ.get(k) for k in RANK_ENVIRONMENT}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, *PASSED_ON)}
    loggers = [
        logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("torch.distributed.elastic")
    ]
    elastic, spawn = logging.getLogger("torch.distributed.elastic"), logging.getLogger(SPAWN_LOGGER)
    saved_log = elastic.propagate, list(elastic.handlers), [(lg, lg.level) for lg in loggers]
    saved_spawn = spawn.propagate, list(spawn.handlers)
    os.environ.update({"OMP_NUM_THREADS": str(threads), "MESHLM_LAUNCHED": "1", LAUNCHER_PID: str(os.getpid())})
    _received_signal = 0
    signal.signal(signal.SIGTERM, _stop_gracefully)
    _quiet_torchelastic(log_file)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for handler in elastic.handlers:
            if handler not in saved_log[1]:
                handler.close()
        elastic.propagate, elastic.handlers = saved_log[0], saved_log[1]
        spawn.propagate, spawn.handlers = saved_spawn
        for lg, level in saved_log[2]:
            lg.setLevel(level)


def _rendezvous_failure(e: BaseException, opts: LaunchOptions, rid: str, host: str, port: int) -> str:
    """One line: what failed, within which bound, which nodes joined and which did not."""
    joined = rendezvous.nodes_joined(rid, opts.nnodes)
    if joined is None:  # this launcher never reached the store: node 0 is not up or not reachable there
        return (
            f"rendezvous at {host}:{port} failed: no answer from node 0 (the rendezvous host; "
            f"--rdzv-timeout {opts.rdzv_timeout} s per connection attempt, {type(e).__name__}); "
            f"start --node-rank 0 on {host} and check the address and port"
        )
    if isinstance(e, RendezvousTimeoutError):
        missing = [n for n in range(opts.nnodes) if n not in joined]
        return (
            f"rendezvous at {host}:{port} did not complete within --rdzv-timeout {opts.rdzv_timeout} s: "
            f"node(s) {', '.join(map(str, joined))} joined, node(s) {', '.join(map(str, missing))} did not; "
            f"start them with the same --rdzv-endpoint and --nnodes {opts.nnodes}"
        )
    return (
        f"rendezvous at {host}:{port} failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
        f"check --rdzv-endpoint and that --node-rank 0 runs on that host"
    )
