"""Start local ranks through torchrun's own launcher API (torch.distributed.launcher).

One launcher per node: standalone (a c10d rendezvous on 127.0.0.1, free port)
for one node, or c10d on the endpoint given for many; either way every socket
listens on one address only (rendezvous.py). Each rank's stderr and
torchelastic error file go to files; the console shows rank 0's progress and,
when ranks fail, the root-cause rank's error once, with where the other ranks
were stuck when the failure was a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshlm import compat, heartbeat, rendezvous
from meshlm.errors import EXIT_USAGE, MeshlmError, interrupted


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
    argv: list[str],
    opts: LaunchOptions,
    out_dir: Path | None,
    rank_main: Callable[[str, list[str]], None],
    command: str = "train",
    stop_timeout_s: float = 30,
) -> int:
    """Run `meshlm <command> <argv>` on opts.nproc local ranks, each `rank_main(command, argv)` (cli.rank_main);
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
    before = _rank_log_sizes(out_dir)
    status, keep_tmp = 1, False
    try:
        with _for_the_ranks(threads, tmp / f"launcher-node-{opts.node_rank}.log"):
            try:
                config = _config(opts, rid, host, port, tmp, stop_timeout_s)
                _start_fork_server()
                elastic_launch(config, entrypoint=rank_main)(command, list(argv))
                status = 0
            except ChildFailedError as e:
                status, keep_tmp = _failed(e.failures, tmp, out_dir, before)
            except SignalException as e:  # torchelastic sent SIGINT on to the ranks and waited for them
                received = _received_signal or e.sigval
                print(f"meshlm: {interrupted(received, out_dir)}", file=sys.stderr)
                status = 128 + received
            except (RendezvousError, OSError, DistError) as e:
                raise MeshlmError(_rendezvous_failure(e, opts, rid, host, port)) from None
        if status in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM) and _opened(out_dir, before):
            _move_files(tmp, out_dir / "logs")
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
        start_method="forkserver",
        logs_specs=RankFiles(str(tmp)),
        local_addr=local_addr,
        shutdown_timeout=max(1, math.ceil(stop_timeout_s)),
        signals_to_handle=",".join(s.name for s in PASSED_ON),  # SIGTERM: _stop_gracefully
    )


# What every rank imports before it does anything (~5 s of CPU: torch, then transformers' modeling_utils, which
# pulls torch._dynamo, DTensor and its quantizers): the fork server imports it once per launch and forks the
# ranks from there, where each rank started as `python -m meshlm` used to import it again.
RANK_IMPORTS = ["meshlm.train.trainer"]  # meshlm first: quiet.py filters what torchao logs at import


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
    # launcher gets one sent meanwhile when it unblocks it, and each rank unblocks it for itself (become_rank).
    # The resource tracker first: starting it unblocks SIGINT in this thread whatever the mask was.
    multiprocessing.resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def become_rank() -> None:
    """The first thing a rank forked by launch() does (cli.rank_main): a session of its own, as torchrun's rank
    processes have, so a terminal's Ctrl-C reaches the launcher only (which passes it on once); and death with
    the launcher."""
    die_with_launcher(int(os.environ[LAUNCHER_PID]))
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked in the fork server it came from


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


LAUNCHER_PID = "MESHLM_LAUNCHER_PID"
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


# ---------------------------------------------------------------- failure report


def _failed(failures, tmp: Path, out_dir: Path | None, before: dict) -> tuple[int, bool]:
    """Report failed ranks: (exit status, whether the report names files in `tmp`, which must then stay).

    A MeshlmError on any rank is bad input: its one line, status 2, and the run directory untouched. Ranks that
    all stopped for SIGINT/SIGTERM (sent to them, not to this launcher) were interrupted. Anything else is a
    failure: the root cause's traceback once, with its files, kept beside the rank logs when the run has them.
    """
    usage = _usage_error(failures, tmp)
    if usage:
        print(usage, file=sys.stderr)
        if _opened(out_dir, before):  # failed while training (a checkpoint it could not write): keep its files
            _move_files(tmp, out_dir / "logs")
        return EXIT_USAGE, False
    codes = {f.exitcode for f in failures.values()}
    stopped = {128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}
    if codes <= stopped and codes & {128 + signal.SIGINT, 128 + signal.SIGTERM}:
        signum = max(c for c in codes if c > 0) - 128
        print(f"meshlm: {interrupted(signum, out_dir)}", file=sys.stderr)
        return 128 + signum, False
    logs = out_dir / "logs" if _opened(out_dir, before) else None
    if logs is not None:
        _move_files(tmp, logs)
    _report(failures, logs or tmp, logs)
    return 1, logs is None


def _usage_error(failures, tmp: Path) -> str | None:
    """The `meshlm: error:` line of the first rank that stopped on bad input (a MeshlmError), whatever the other
    ranks did meanwhile (lost their peer, were stopped by the launcher): from its error file, written before the
    line was printed, else from its stderr."""
    lines = {}
    for rank, failure in failures.items():
        msg = failure.message
        text = msg.get("message", "") if isinstance(msg, dict) else ""
        if text.startswith(f"{MeshlmError.__name__}: "):
            lines[rank] = (failure.timestamp or float("inf"), "meshlm: error: " + text.split(": ", 1)[1])
            continue
        p = tmp / f"rank-{rank}.stderr"
        printed = (
            [ln for ln in p.read_text(errors="replace").splitlines() if ln.startswith("meshlm: error:")]
            if (p.is_file())
            else []
        )
        if printed:
            lines[rank] = (failure.timestamp or float("inf"), printed[-1])
    if not lines:
        return None
    return min(lines.items(), key=lambda kv: (kv[1][0], kv[0]))[1][1]


def _message(failure) -> tuple[str, str]:
    """(one-line error, traceback) from the failure's error file, read when torchelastic collected it."""
    msg = failure.message
    if isinstance(msg, dict):
        return msg.get("message", ""), msg.get("extraInfo", {}).get("py_callstack", "")
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}", ""
    return str(msg or ""), ""


# What a rank raises when a *peer* died under it: never the root cause while another rank raised something else.
COLLATERAL = re.compile(
    r"its error is the cause|closed by peer|reset by peer|broken pipe|remote worker crashing|"
    r"process group.*abort",
    re.IGNORECASE,
)


def _root_cause(failures) -> tuple[int, object]:
    """The rank that failed first: one that raised an exception of its own, else one that died of a signal
    other than the launcher's SIGTERM (killed from outside, crashed), else one that lost its peer, else any.

    A rank killed with SIGKILL leaves no error file, while the peer it leaves in a collective raises "connection
    closed" at once and may write its error file before the launcher's next look at its ranks: that collateral
    error must not hide the killed rank. Error-file timestamps have one-second resolution, so they only order
    ranks of the same kind.
    """

    def kind(failure) -> int:
        if isinstance(failure.message, dict):
            return 2 if COLLATERAL.search(_message(failure)[0]) else 0
        return 3 if failure.exitcode == -signal.SIGTERM else 1

    return min(failures.items(), key=lambda kv: (kind(kv[1]), kv[1].timestamp or float("inf"), kv[0]))


TIMEOUT = re.compile(r"timed? ?out|timing out", re.IGNORECASE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')


def stuck_at(log_text: str) -> str | None:
    """Where a rank's main thread was, from the faulthandler dump that ends its log (None if it ends otherwise).

    A rank the launcher terminates dumps every thread's stack on SIGTERM (runtime.dump_stacks_on_signal);
    the main thread is the one running the module (`<module>`).
    """
    lines = log_text.rstrip("\n").splitlines()
    blocks, block = [], []
    for ln in reversed(lines):  # the dump is the tail: thread headers and frame lines only
        if _FRAME.match(ln):
            block.append(ln)
        elif ln.startswith(("Current thread 0x", "Thread 0x")):
            blocks.append(list(reversed(block)))
            block = []
        elif ln.strip() and not ln.startswith("Extension modules:"):  # that line ends a fatal-signal dump
            break
    main = next((b for b in blocks if any(ln.endswith(" in <module>") for ln in b)), None)
    if not main:
        return None
    frames = [_FRAME.match(ln).groupdict() for ln in main]
    caller = next((f for f in frames[1:] if "/meshlm/" in f["file"]), None)  # meshlm's code that got there
    return " called from ".join(f"{f['func']} ({Path(f['file']).name}:{f['line']})" for f in (frames[0], caller) if f)


def _report(failures, files: Path, logs: Path | None) -> None:
    rank, failure = _root_cause(failures)
    message, tb = _message(failure)
    print(f"meshlm: rank {rank} failed (exit code {failure.exitcode}): {message}", file=sys.stderr)
    if tb:
        print(tb.rstrip(), file=sys.stderr)
    # After a timeout the useful part is where the *other* ranks were; after an ordinary error they are noise.
    no_error_files = not any(isinstance(f.message, dict) for f in failures.values())
    if logs is not None and (TIMEOUT.search(message) or no_error_files):
        for log in sorted(logs.glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1])):
            other = int(log.stem.split("-")[1])
            if other != rank:
                _where(other, failures.get(other), logs, timed_out=bool(TIMEOUT.search(message)))
    log = f", log {logs / f'rank-{rank}.log'}" if logs is not None else ""
    print(
        f"meshlm: rank {rank}: error file {files / f'rank-{rank}.error.json'}, "
        f"stderr {files / f'rank-{rank}.stderr'}{log}",
        file=sys.stderr,
    )


def _where(rank: int, failure, logs: Path, timed_out: bool) -> None:
    """Where another rank was when the job failed: its stack dump, or, after a timeout, when it left none (frozen,
    stopped with SIGSTOP: it could not answer SIGTERM and was killed, or was still unanswering when the others
    failed), the step it last entered (heartbeat.py)."""
    log = logs / f"rank-{rank}.log"
    where = stuck_at(log.read_text(errors="replace"))
    step = heartbeat.last_step(logs, rank)
    at = f" at step {step}" if step is not None else ""
    if where:
        print(f"meshlm: rank {rank} was stuck in {where}{at}; its stacks are in {log}", file=sys.stderr)
    elif timed_out and (failure is None or failure.exitcode == -signal.SIGKILL):
        print(
            f"meshlm: rank {rank} stopped answering{at}: it left no stack dump on SIGTERM and was killed "
            f"(frozen or stopped, e.g. by SIGSTOP); the others' timeouts follow from it",
            file=sys.stderr,
        )


def _rank_log_sizes(out_dir: Path | None) -> dict[str, int]:
    logs = out_dir / "logs" if out_dir is not None else None
    if logs is None or not logs.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in logs.glob("rank-*.log")}


def _opened(out_dir: Path | None, before: dict[str, int]) -> bool:
    """Whether this job's ranks opened the run directory: a rank log is new or has grown (every start logs)."""
    after = _rank_log_sizes(out_dir)
    return any(size > before.get(name, -1) for name, size in after.items())


def _move_files(tmp: Path, logs: Path) -> None:
    """The ranks' stderr and error files and the launcher log, next to the rank logs."""
    for f in tmp.iterdir():
        if f.stat().st_size or f.suffix == ".stderr":
            shutil.move(str(f), logs / f.name)
