"""Start local ranks through torchrun's own launcher API (torch.distributed.launcher).

One launcher per node: standalone (a c10d rendezvous on 127.0.0.1, free port)
for one node, or c10d on the endpoint given for many. Each rank's stderr and
torchelastic error file go to files; the console shows rank 0's progress and,
when ranks fail, the root-cause rank's traceback once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshlm.errors import EXIT_USAGE


@dataclass
class LaunchOptions:
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    max_restarts: int = 0
    omp_threads: int = 0  # 0: cores / local ranks, at least 1


class RankFiles(LogsSpecs):
    """stderr and error file of global rank N at <dir>/rank-N.stderr and rank-N.error.json; stdout stays on the console."""

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


def _usage_error(failures, tmp: Path) -> str | None:
    """The `meshlm: error:` line a rank printed before exiting 2, if the job failed on bad input."""
    if not failures or any(f.exitcode != EXIT_USAGE for f in failures.values() if f.exitcode > 0):
        return None
    for rank in sorted(failures):
        p = tmp / f"rank-{rank}.stderr"
        if p.is_file():
            lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.startswith("meshlm: error:")]
            if lines:
                return lines[-1]
    return None


def _root_cause(failures) -> tuple[int, object]:
    """The rank that failed first with a recorded exception (others were killed after it)."""
    with_file = {r: f for r, f in failures.items() if f.error_file and os.path.isfile(f.error_file)}
    pool = with_file or failures
    return min(pool.items(), key=lambda kv: (kv[1].timestamp or float("inf"), kv[0]))


def _traceback(failure) -> str:
    try:
        data = json.loads(Path(failure.error_file).read_text())["message"]
        return data["extraInfo"]["py_callstack"] if isinstance(data, dict) else str(data)
    except (OSError, KeyError, TypeError, ValueError):
        return ""


def launch(argv: list[str], opts: LaunchOptions, out_dir: Path | None, command: str = "train") -> int:
    """Run `meshlm <command> <argv>` on opts.nproc local ranks; returns the exit status.

    out_dir is where the ranks' logs/ go (a run directory); None for commands without one (generate):
    the ranks' stderr files are then kept in a temporary directory only when the job fails.
    """
    tmp = Path(tempfile.mkdtemp(prefix="meshlm-launch-"))
    threads = opts.omp_threads or max(1, (os.cpu_count() or 1) // opts.nproc)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MESHLM_LAUNCHED"] = "1"
    if opts.nnodes == 1 and not opts.rdzv_endpoint:
        endpoint, rdzv_configs = "127.0.0.1:0", {"is_host": True}  # standalone: loopback only
    else:
        endpoint, rdzv_configs = opts.rdzv_endpoint, {"is_host": opts.node_rank == 0}
    config = LaunchConfig(min_nodes=opts.nnodes, max_nodes=opts.nnodes, nproc_per_node=opts.nproc,
                          run_id=opts.rdzv_id or f"meshlm-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs, max_restarts=opts.max_restarts,
                          monitor_interval=0.1, start_method="spawn", logs_specs=RankFiles(str(tmp)),
                          local_addr="127.0.0.1" if opts.nnodes == 1 else None)
    # torchelastic logs every SIGTERM it sends and every exit code: the summary below says it once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    status = 0
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "meshlm", command, *argv)
    except ChildFailedError as e:
        usage = _usage_error(e.failures, tmp)
        if usage:  # bad input: nothing of this attempt is kept, the output directory stays as it was
            shutil.rmtree(tmp, ignore_errors=True)
            print(usage, file=sys.stderr)
            return EXIT_USAGE
        rank, failure = _root_cause(e.failures)
        tb = _traceback(failure)  # read before the files move
        where = _keep_logs(tmp, out_dir) or tmp
        print(f"meshlm: rank {rank} failed (exit code {failure.exitcode})", file=sys.stderr)
        if tb:
            print(tb.rstrip(), file=sys.stderr)
        log = f", log {out_dir / 'logs' / f'rank-{rank}.log'}" if out_dir is not None else ""
        print(f"meshlm: rank {rank}: error file {where / f'rank-{rank}.error.json'}, "
              f"stderr {where / f'rank-{rank}.stderr'}{log}", file=sys.stderr)
        status = 1
    else:
        if _keep_logs(tmp, out_dir) is None:
            shutil.rmtree(tmp, ignore_errors=True)  # a success leaves no stray temporary files
    return status


def _keep_logs(tmp: Path, out_dir: Path | None) -> Path | None:
    """Move the ranks' stderr/error files next to their logs once the run has an output directory.

    A run rejected on bad input never created it, and its directory (if any) stays untouched.
    """
    if out_dir is None:
        return None
    logs = out_dir / "logs"
    if not logs.is_dir() or not any(logs.glob("rank-*.log")):
        return None
    for f in tmp.iterdir():
        if f.stat().st_size or f.suffix == ".stderr":
            shutil.move(str(f), logs / f.name)
    shutil.rmtree(tmp, ignore_errors=True)
    return logs
