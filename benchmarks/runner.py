"""How the benchmark scripts run a job and read its numbers (shared by overhead, scaling, vs_accelerate).

Every run is a fresh subprocess with one OpenMP thread per rank; tokens/s counts only steps after
the warm-up interval; memory is rank 0's peak resident set (CPU) or peak allocated bytes (CUDA).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def available(name: str, nproc: int, strategy: str = "auto", tp: int = 1, global_batch: int = 16) -> str:
    """'' when this tree's meshlm can run the layout, else why not (verify's own check: no faked rows)."""
    from meshlm.config import Config
    from meshlm.verify import Case, unavailable

    return unavailable(Case(name, nproc if nproc > 1 else 0, strategy, tp=tp), Config(), global_batch)


def metrics_rows(nproc: int, steps: int, log_every: int, micro: int, *extra: str) -> list[dict]:
    """`meshlm train` (defaults plus `extra`, one OpenMP thread per rank) -> its metrics.jsonl rows."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "meshlm",
            "train",
            "--max-steps",
            str(steps),
            "--log-every",
            str(log_every),
            "--micro-batch-size",
            str(micro),
            "--progress",
            "false",
            "--save-final",
            "false",
            "--output-dir",
            out,
            *extra,
        ]
        if nproc > 1:
            cmd += ["--nproc", str(nproc), "--omp-threads", "1"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def meshlm(nproc: int, steps: int, warmup: int, micro: int, *extra: str) -> dict:
    """`meshlm train` (defaults plus `extra`) -> tokens/s after warm-up, rank 0's peak memory (and on CUDA what
    the allocator reserved), final loss."""
    rows = metrics_rows(nproc, steps, warmup, micro, *extra)
    timed = rows[1:]  # the first interval holds the warm-up; each row covers `warmup` steps
    tps = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / sum(r["step_time_s"] for r in timed)
    mfu = sum(r["mfu"] * r["step_time_s"] for r in timed) / sum(r["step_time_s"] for r in timed)
    dense = sum(r.get("mfu_dense", math.nan) * r["step_time_s"] for r in timed) / sum(r["step_time_s"] for r in timed)
    return {
        "tokens_per_s": tps,
        "mfu": mfu,
        "mfu_dense": dense,
        "peak_bytes": max(r["mem_peak_bytes"] for r in rows),
        "reserved_bytes": max(r.get("mem_reserved_bytes", math.nan) for r in rows),  # CUDA's caching allocator
        "loss": rows[-1]["loss"],
        "warmup_s": rows[0]["step_time_s"] * warmup,
    }


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
