"""`make gpu-check`: what only CUDA GPUs can show, on whatever GPUs this machine has.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR] [--only NAME,...]

Uses the machine's python as it is (no virtual environment, no installs, no network; `datasets` is
not needed), except the torchtitan check (below). Each check runs on its own (real `meshlm` processes) and
passes or fails on its own; gpu-check.md (a table to paste into BENCHMARKS.md) and gpu-check.json (every
number) go to --out, and the exit status is 1 if any check failed. Without a CUDA GPU it says so in one line
and exits 0.

1 GPU: the default job in fp32 and bf16, --compile, zero3 --cpu-offload (CUDA peak memory against
the plain run), the tests marked gpu (layer-split cuda:0,cpu, generate against
transformers' generate on the GPU, offload), `meshlm plan --validate` for a ~1B model, and the MFU
benchmark (gpu_mfu.py: ~1B Llama in bf16, with and without compile and activation checkpointing), and
torchtitan's Llama 3 trainer on the same ~1B job (peer_torchtitan.py: the one check that installs a package,
torchtitan, into a venv over this python's packages when this python lacks it).
2+ GPUs: nn.DataParallel wrapping them, the tests marked gpu that need two (DataParallel, SyncBatchNorm);
over NCCL every layout's losses against the one-GPU run (ddp, zero1-3, offload, tp, pp; hsdp and fsdp+tp
with 4), pipelined generation, a rank failing while resuming, and `meshlm verify`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

try:
    import torch
except ImportError:  # this python has no torch (a CPU machine following the README): said in main, in one line
    torch = None
from gpu_runs import ENV, CheckFailed


def run_check(name: str, fn, tmp: Path) -> dict:
    t0 = time.perf_counter()
    try:
        detail, numbers = fn(tmp / name.replace(" ", "_").replace("/", "_"))
        ok = True
    except (CheckFailed, AssertionError, subprocess.TimeoutExpired) as e:
        detail, numbers, ok = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__, {}, False
    except Exception as e:  # noqa: BLE001 -- a bug in one check still leaves the others to run
        detail, numbers, ok = f"{type(e).__name__}: {e}"[:300], {"traceback": traceback.format_exc()}, False
    result = {"check": name, "ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 1), **numbers}
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return result


def machine() -> dict:
    import transformers

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def report(results: list[dict], info: dict, out: Path) -> None:
    (out / "gpu-check.json").write_text(json.dumps({"machine": info, "results": results}, indent=1) + "\n")
    failed = [r for r in results if not r["ok"]]
    lines = [
        f"## make gpu-check: {len(info['gpus'])} x {info['gpus'][0]}",
        "",
        (
            f"torch {info['torch']} (CUDA {info['cuda']}), transformers {info['transformers']}, "
            f"python {info['python']}; {len(results) - len(failed)} of {len(results)} checks passed."
        ),
        "",
        "| check | result | detail | s |",
        "|---|---|---|---:|",
    ]
    lines += [
        f"| {r['check']} | {'pass' if r['ok'] else '**FAIL**'} | {r['detail'].replace('|', '/')} | {r['seconds']} |"
        for r in results
    ]
    (out / "gpu-check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="where gpu-check.md and gpu-check.json go [.]")
    ap.add_argument("--only", default="", help="comma-separated check names (substrings) to run")
    args = ap.parse_args(argv)
    if torch is None:
        gpu = Path("/dev/nvidiactl").exists()  # a GPU machine whose python lacks torch is a failed check
        print(
            f"gpu-check: {sys.executable} has no torch; "
            + (
                "install it there, or run make gpu-check PYTHON=.venv/bin/python"
                if gpu
                else "and this machine has no GPU: nothing to check here"
            )
        )
        return 1 if gpu else 0
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            f"nothing to check here, run it on a GPU machine"
        )
        return 0
    os.environ["PYTHONPATH"] = ENV["PYTHONPATH"]  # gpu_mfu's runner starts meshlm with os.environ
    from gpu_checks import checks

    gpus = torch.cuda.device_count()
    todo = [
        (name, fn)
        for name, need, fn in checks(gpus)
        if need <= gpus and (not args.only or any(s in name for s in args.only.split(",")))
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"gpu-check: {gpus} x {info['gpus'][0]}, torch {info['torch']}; {len(todo)} checks", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        results = [run_check(name, fn, Path(tmp)) for name, fn in todo]
    report(results, info, out)
    failed = sum(not r["ok"] for r in results)
    print(
        f"gpu-check: {len(results) - failed} passed, {failed} failed; wrote {out / 'gpu-check.md'} and "
        f"{out / 'gpu-check.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
