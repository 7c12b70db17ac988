"""What the checks of `make gpu-check` share (gpu_checks.py defines them, gpu_check.py runs them): the job, the
tolerance, and `meshlm train` on the GPUs with its metrics rows. Imports neither of them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    "PYTHONUNBUFFERED": "1",
}
MODEL = [
    "--arch.hidden-size",
    "256",
    "--arch.layers",
    "4",
    "--arch.heads",
    "8",
    "--arch.kv-heads",
    "4",
    "--arch.intermediate-size",
    "704",
    "--seq-length",
    "128",
    "--builtin-samples",
    "2000",
    "--progress",
    "false",
    "--log-every",
    "1",
    "--warmup-steps",
    "2",
]
STEPS = ["--max-steps", "10"]
RTOL = 1e-4  # fp32 on GPUs: reduction order only (NCCL rings, cuBLAS split-k)


class CheckFailed(Exception):
    pass


def meshlm(*args: str, env: dict | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm", *map(str, args)],
        capture_output=True,
        text=True,
        env={**ENV, **(env or {})},
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def train(out: Path, *args: str, nproc: int = 1) -> list[dict]:
    """`meshlm train` on the GPU(s); its metrics rows, or CheckFailed with the end of its stderr."""
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    p = meshlm("train", *launch, *MODEL, *args, "--output-dir", out)
    if p.returncode:
        raise CheckFailed(f"meshlm train {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-1500:]}")
    if "cuda" not in p.stdout + p.stderr and "nccl" not in p.stdout + p.stderr:
        raise CheckFailed("the run did not say it ran on cuda/nccl")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def worst(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise CheckFailed(f"{len(a)} losses vs {len(b)}")
    diffs = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)  # max() skips a NaN that is not first


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]
