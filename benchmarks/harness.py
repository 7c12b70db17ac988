"""How every benchmark runs `meshlm train` and measures it, and how a measurement becomes a results line.

One place owns the `meshlm train` command line (`train_command`), the run (a fresh subprocess, one OpenMP thread
per rank) and what it measures: tokens/s after the warm-up interval (from metrics.jsonl), CPU seconds of every
process of the job (getrusage of the children: user + system), the peak RSS of each rank (VmHWM of the job's
processes that start no process of their own, polled from /proc while the job runs), and the machine (CPU model,
cores, load average before and after, torch and transformers versions, git commit). A case of a suite
(benchmarks/suites.py) turns that into one JSON line appended to benchmarks/results/SUITE.jsonl (run.py runs
them); render.py makes BENCHMARKS.md from those files.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def available(name: str, nproc: int, strategy: str = "auto", tp: int = 1, global_batch: int = 16) -> str:
    """'' when this tree's meshlm can run the layout, else why not (verify's own check: no faked rows)."""
    from meshlm.config import Config
    from meshlm.verify import Case, unavailable

    return unavailable(Case(name, nproc if nproc > 1 else 0, strategy, tp=tp), Config(), global_batch)


def train_command(out: str, nproc: int, steps: int, log_every: int | None, micro: int | None, *extra: str) -> list[str]:
    """`meshlm train` with the benchmarks' fixed choices (no progress bar, no final save) plus `extra`; a
    `log_every` or `micro` of None keeps meshlm's default."""
    cmd = [sys.executable, "-m", "meshlm", "train", "--max-steps", str(steps)]
    cmd += [] if log_every is None else ["--log-every", str(log_every)]
    cmd += [] if micro is None else ["--micro-batch-size", str(micro)]
    cmd += ["--progress", "false", "--save-final", "false", "--output-dir", out, *extra]
    if nproc > 1:
        cmd += ["--nproc", str(nproc), "--omp-threads", "1"]
    return cmd


def _children() -> dict[int, int]:
    """pid -> parent pid of every process on the machine (what /proc shows this user)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def _peak_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RankMemory(threading.Thread):
    """Polls the process tree under `root`: the highest VmHWM of each process that starts none of its own (a rank,
    or the one process of a single-process run). VmHWM only grows, so the last poll before a rank exits holds its
    peak up to the polling interval."""

    def __init__(self, root: int, every: float = 0.25):
        super().__init__(daemon=True)
        self.root, self.every, self.peaks, self.parents_seen = root, every, {}, set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            parents = _children()
            tree, frontier = {self.root}, [self.root]
            while frontier:
                frontier = [p for p, pp in parents.items() if pp in frontier and p not in tree]
                tree.update(frontier)
            self.parents_seen.update(pp for p, pp in parents.items() if p in tree and pp in tree)
            for pid in tree:
                self.peaks[pid] = max(self.peaks.get(pid, 0), _peak_rss(pid))
            self.done.wait(self.every)

    def ranks(self) -> list[int]:
        """Peak bytes of each leaf process, by pid (start order)."""
        return [b for pid, b in sorted(self.peaks.items()) if pid not in self.parents_seen and b]


def run_job(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` to its end: wall s, CPU s of all its processes, each rank's peak RSS; raises on failure."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV)
    watch = RankMemory(p.pid)
    watch.start()
    out, err = p.communicate()
    watch.done.set()
    watch.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu, "peak_rss_bytes_per_rank": watch.ranks(), "stdout": out}


def largest_rss(cmd: list[str]) -> int:
    """ru_maxrss (bytes) of the largest process of `cmd`, measured in a wrapper of its own (the kernel's own count,
    exact where polling could miss a short peak)."""
    probe = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stderr.write(r.stderr[-2000:] if r.returncode else ''); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 if r.returncode == 0 else -1)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    value = int(out.stdout.strip().splitlines()[-1])
    if value < 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return value


def metrics(out: str | Path) -> list[dict]:
    """The metrics.jsonl rows of the run directory `out` (blank lines skipped)."""
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def train_rows(nproc: int, steps: int, log_every: int, micro: int, *extra: str) -> list[dict]:
    """`meshlm train` (defaults plus `extra`, one OpenMP thread per rank) -> its metrics.jsonl rows."""
    return train_run(nproc, steps, log_every, micro, *extra)["rows"]


def train_run(nproc: int, steps: int, log_every: int, micro: int, *extra: str) -> dict:
    """`meshlm train` -> run_job's measurements plus the metrics.jsonl rows and the command (output dir elided)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = train_command(out, nproc, steps, log_every, micro, *extra)
        job = run_job(cmd)
        job["rows"] = metrics(out)
    job["command"] = " ".join(["meshlm", *cmd[3:]]).replace(out, "OUT")
    return job


def summary(rows: list[dict], warmup: int) -> dict:
    """metrics.jsonl rows -> tokens/s and MFU after the warm-up interval (the first row, `warmup` steps), rank 0's
    peak memory (and on CUDA what the allocator reserved), final loss."""
    timed = rows[1:]
    t = sum(r["step_time_s"] for r in timed)
    return {
        "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / t,
        "mfu": sum(r["mfu"] * r["step_time_s"] for r in timed) / t,
        "mfu_dense": sum(r.get("mfu_dense", math.nan) * r["step_time_s"] for r in timed) / t,
        "peak_bytes": max(r["mem_peak_bytes"] for r in rows),
        "reserved_bytes": max(r.get("mem_reserved_bytes", math.nan) for r in rows),  # CUDA's caching allocator
        "loss": rows[-1]["loss"],
        "warmup_s": rows[0]["step_time_s"] * warmup,
    }


def train(nproc: int, steps: int, warmup: int, micro: int, *extra: str) -> dict:
    """`meshlm train` (defaults plus `extra`) -> summary() of its rows; each row covers `warmup` steps."""
    return summary(train_rows(nproc, steps, warmup, micro, *extra), warmup)


def script(launcher: list[str], path: Path, *args: str) -> dict:
    """A baseline script under a launcher; it prints one JSON line (tokens_per_s, peak_bytes, loss) last."""
    p = subprocess.run([*launcher, str(path), *args], capture_output=True, text=True, env=ENV)
    if p.returncode:
        raise RuntimeError(f"{' '.join(launcher)} {path.name} {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def torchrun(nproc: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def best(repeats: int, *jobs) -> list[dict]:
    """The fastest of `repeats` runs of each job (a zero-argument callable): noise on a shared machine
    only ever slows a run down. The jobs take turns, so a slow minute hurts each of them alike."""
    runs = [[job() for job in jobs] for _ in range(repeats)]
    return [max((r[i] for r in runs), key=lambda x: x["tokens_per_s"]) for i in range(len(jobs))]


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def machine() -> dict:
    """The machine a measurement ran on, without importing torch (the versions are the installed packages')."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in _lines("/proc/cpuinfo") if ln.startswith("model name")), "")
    gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if _has("nvidia-smi") else None
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "gpu": gpu.stdout.strip().splitlines()[0] if gpu and gpu.returncode == 0 and gpu.stdout.strip() else None,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _has(tool: str) -> bool:
    return any((Path(d) / tool).exists() for d in os.environ.get("PATH", "").split(os.pathsep) if d)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def commit() -> str:
    """The tree's commit, with '+' when the work tree differs from it (the measured code is then not the commit)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def measure(case, conditions: str | None) -> dict:
    """Run one case of a suite and return its results line."""
    load_before = os.getloadavg()[0]
    got = case.measure()
    load_after = os.getloadavg()[0]
    m = machine()
    quiet = max(load_before, load_after) < 0.5 * (m["cores"] or 1)
    return {
        "id": case.id,
        "value": got.pop("value"),
        "unit": case.unit,
        "target": list(case.target) if case.target else None,  # as the suite stated it when this ran
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": m,
        "load": [round(load_before, 2), round(load_after, 2)],
        "conditions": conditions or ("quiet" if quiet else "loaded"),
        "command": case.command,
        "source": "harness",
        "measurements": got,
    }


def append(suite: str, line: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{suite}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
    return path
