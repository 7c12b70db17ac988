"""What the checks of `make gpu-check` share (gpu_check_rows.py defines them, gpu_check.py runs them): the job, the
tolerance, and `meshlm train` on the GPUs with its metrics rows. Imports neither of them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from harness import metrics

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

# What the lent GPU machine's image lacks (the device tool's KINDS.md package list), for its Python 3.12 and
# torch 2.11, by the group of rows that needs it; each group installs into its own directory that only those
# rows see, so meshlm's own runs keep the image's packages.
WHEELS = {
    "torchao": ["torchao==0.18.0"],  # --float8
    "torchtitan": [
        "torchtitan==0.2.2",  # 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 lacks
        *["torchdata==0.11.0", "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1"],
        *["datasets==4.7.0", "dill==0.4.0", "multiprocess==0.70.18"],  # its text data loader reads through datasets
        *["fsspec==2026.2.0", "typing-extensions==4.16.0"],  # the newest datasets 4.7 and typeguard accept
    ],
}
WHEEL_DIR = ROOT / ".whl"

# Estimates before a row starts (--dry-run, and the deadline check): allowances, not measurements
PEAK_FLOPS = 989e12  # dense bf16 of an H100 SXM and an H200 (meshlm/hardware.py)
ASSUMED_MFU = 0.3  # below the 44.9% the ~1B job measured compiled on one H100, so that estimates err long
START_S = 30  # a process: python, torch and transformers imported, the data packed, the model built on the GPU
COMPILE_S = 70  # Inductor compiling one block's forward and backward (the other blocks reuse its code)
INSTALL_S = 10  # pip installing a group of wheels from .whl


def estimate(runs: int = 1, steps: int = 0, params: float = 0, tokens: int = 0, compiled: bool = False) -> float:
    """Seconds for `runs` processes of `steps` steps of `tokens` tokens on a model of `params` parameters."""
    step = 6 * params * tokens / (PEAK_FLOPS * ASSUMED_MFU)
    return runs * (START_S + (COMPILE_S if compiled else 0) + steps * step)


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
    return metrics(out)


def worst(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise CheckFailed(f"{len(a)} losses vs {len(b)}")
    diffs = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)  # max() skips a NaN that is not first


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]
