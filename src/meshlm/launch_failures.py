"""What the launcher says when ranks fail: bad input (one rank's `meshlm: error:` line), an interruption, or the
root cause's error once, with where the other ranks were stuck when the failure was a timeout (their stack dumps,
else the step their heartbeat last named); and where the ranks' files go. launch.py starts the ranks and calls
`failed` with torchelastic's failures."""

from __future__ import annotations

import re
import shutil
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from meshlm import heartbeat
from meshlm.errors import EXIT_USAGE, MeshlmError, interrupted


def failed(failures, tmp: Path, out_dir: Path | None, before: dict) -> tuple[int, bool]:
    """Report failed ranks: (exit status, whether the report names files in `tmp`, which must then stay).

    A MeshlmError on any rank is bad input: its one line, status 2, and the run directory untouched. Ranks that
    all stopped for SIGINT/SIGTERM (sent to them, not to this launcher) were interrupted. Anything else is a
    failure: the root cause's traceback once, with its files, kept beside the rank logs when the run has them.
    """
    failures = with_error_files(failures, tmp)
    usage = _usage_error(failures, tmp)
    if usage:
        print(usage, file=sys.stderr)
        if opened(out_dir, before):  # failed while training (a checkpoint it could not write): keep its files
            move_files(tmp, out_dir / "logs")
        return EXIT_USAGE, False
    codes = {f.exitcode for f in failures.values()}
    stopped = {128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}
    if codes <= stopped and codes & {128 + signal.SIGINT, 128 + signal.SIGTERM}:
        signum = max(c for c in codes if c > 0) - 128
        print(f"meshlm: {interrupted(signum, out_dir)}", file=sys.stderr)
        return 128 + signum, False
    logs = out_dir / "logs" if opened(out_dir, before) else None
    if logs is not None:
        move_files(tmp, logs)
    _report(failures, logs or tmp, logs)
    return 1, logs is None


def with_error_files(failures: dict, tmp: Path) -> dict:
    """torchelastic's failures and every other rank of this node that left an error file in `tmp`.

    torchelastic reports the one rank its poll found dead first; when a rank raises and its peer, losing the
    connection, fails a moment later, both may be dead by that poll and the peer is the one reported: the
    rank that raised, the root cause (or a `meshlm: error:` line), would be missing. Its status: EXIT_USAGE
    for bad input (exit_status), else 1, as an uncaught exception leaves a rank."""
    found = dict(failures)
    for path in tmp.glob("rank-*.error.json"):
        rank = int(path.name.split(".")[0].removeprefix("rank-"))
        if rank not in found:
            failure = ProcessFailure(local_rank=-1, pid=-1, exitcode=1, error_file=str(path))
            text = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
            failure.exitcode = EXIT_USAGE if text.startswith(f"{MeshlmError.__name__}: ") else 1
            found[rank] = failure
    return found


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


def rank_log_sizes(out_dir: Path | None) -> dict[str, int]:
    logs = out_dir / "logs" if out_dir is not None else None
    if logs is None or not logs.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in logs.glob("rank-*.log")}


def opened(out_dir: Path | None, before: dict[str, int]) -> bool:
    """Whether this job's ranks opened the run directory: a rank log is new or has grown (every start logs)."""
    after = rank_log_sizes(out_dir)
    return any(size > before.get(name, -1) for name, size in after.items())


def move_files(tmp: Path, logs: Path) -> None:
    """The ranks' stderr and error files and the launcher log, next to the rank logs."""
    for f in tmp.iterdir():
        if f.stat().st_size or f.suffix == ".stderr":
            shutil.move(str(f), logs / f.name)
