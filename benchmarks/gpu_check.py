"""`make gpu-check`: what only CUDA GPUs can show, sized for one lease of a GPU machine.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR] [--deadline S] [--all | --only NAME,...] [--dry-run]
    python3 benchmarks/gpu_check.py --download-wheels     # here, with the registry: `make gpu-wheels`

Uses the machine's python as it is (no virtual environment, no network; `datasets` is not needed by meshlm). By
default it runs the first-lease set (gpu_check_rows.rows(), in order): the ~1B packed job compiled in bf16 at sequence
2048 with sdpa (the headline: tokens/s, mfu, mfu_dense, peak memory), with flex, with float8 tensorwise, and
torchtitan on the flex row's job; then, while time is left, the short correctness rows. --all adds the rest (the
MFU table, ~3B float8, sequence 8192 and 64k, the tests marked gpu, the rows of 2+ GPUs).

Each row runs in a forked process group of its own. Before a row starts, its estimate is checked against the
time left before --deadline (else it is "not run"); a row still running at the deadline is killed and reported
"cut", with the last metrics row each of its runs had logged. gpu-check.json and gpu-check.md (the table for a
write-up in benchmarks/campaigns/) are rewritten in --out (default $OUT where set, else .) the moment each row
ends. The wheels a row needs (gpu_check_jobs.WHEELS: torchao, torchtitan) are installed from .whl alone into a
directory only that row sees; a missing wheel makes its rows "not run". Exit status 1 if a row failed; without a
CUDA GPU, one line and exit 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
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
import gpu_check_rows
import harness
from gpu_check_jobs import ENV, INSTALL_S, WHEEL_DIR, WHEELS, CheckFailed

DEADLINE_S = 540  # the device tool's 600 s per command, less a minute to write the files and hand them back
INSTALLED = Path(tempfile.gettempdir()) / "meshlm-gpu-wheels"  # one directory per WHEELS group
WHEEL_BUDGET = 40 * 2**20  # the working tree travels under 64 MiB, wheels included
PARTIAL = ("step", "loss", "tokens_per_s", "mfu", "mfu_dense", "mem_peak_bytes")


def run_check(name: str, fn, tmp: Path) -> dict:
    """`fn` in `tmp`: passed with its detail and numbers, or failed with the error's last line."""
    t0 = time.perf_counter()
    try:
        detail, numbers = fn(tmp)
        status = "pass"
    except (CheckFailed, AssertionError, subprocess.TimeoutExpired) as e:
        detail, numbers, status = (
            str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__,
            {},
            "FAIL",
        )
    except Exception as e:  # noqa: BLE001 -- a bug in one check still leaves the others to run
        detail, numbers, status = f"{type(e).__name__}: {e}"[:300], {"traceback": traceback.format_exc()}, "FAIL"
    return {"check": name, "status": status, "detail": detail, "seconds": round(time.perf_counter() - t0, 1), **numbers}


def _child(name: str, fn, work: Path, env: dict) -> None:
    """A forked row: its own process group (killed whole at the deadline), temporary files in `work`, `env` in the
    environment of the runs it starts."""
    os.setsid()
    for shared in (os.environ, ENV, harness.ENV):
        shared.update(env)
    tempfile.tempdir = str(work)  # the runs' output directories land where a cut row's metrics are read
    result = run_check(name, fn, work)
    (work / "result.json").write_text(json.dumps(result, default=str))
    os._exit(0)


def _kill(pid: int) -> None:
    """The row's process group, and any descendant that left it (torchrun's workers)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, todo = [], [pid]
    while todo:
        doomed.append(todo.pop())
        todo += children.get(doomed[-1], [])
    for signal_to, target in ((os.killpg, pid), *((os.kill, p) for p in doomed)):
        try:
            signal_to(target, signal.SIGKILL)
        except OSError:
            pass


def partial(work: Path) -> dict:
    """The last metrics row of each run a cut row had started, by its directory."""
    found = {}
    for metrics in sorted(work.rglob("metrics.jsonl")):
        lines = [x for x in metrics.read_text().splitlines() if x.strip()]
        if lines:
            last = json.loads(lines[-1])
            found[str(metrics.parent.relative_to(work))] = {k: last[k] for k in PARTIAL if k in last}
    return {"partial": found} if found else {}


def run_row(name: str, fn, work: Path, limit: float, env: dict | None = None) -> dict:
    """`fn` in a forked process with `env` set, for at most `limit` seconds: its result, or "cut" with what its
    runs had logged."""
    work.mkdir(parents=True)
    t0 = time.monotonic()
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(name, fn, work, env or {}))
    proc.start()
    proc.join(max(limit, 0))
    seconds = round(time.monotonic() - t0, 1)
    if proc.is_alive():
        _kill(proc.pid)
        proc.join()
        detail = f"cut at the deadline after {seconds:.0f} s"
        return {"check": name, "status": "cut", "detail": detail, "seconds": seconds, **partial(work)}
    if (work / "result.json").exists():
        return json.loads((work / "result.json").read_text())
    return {"check": name, "status": "FAIL", "detail": f"the row's process exited {proc.exitcode}", "seconds": seconds}


def wheel_files(group: str) -> tuple[list[Path], list[str]]:
    """The .whl files of a WHEELS group, and the requirements it lacks."""
    found, missing = [], []
    for spec in WHEELS[group]:
        name, version = spec.split("==")
        files = sorted(WHEEL_DIR.glob(f"{name.replace('-', '_').lower()}-{version}-*.whl"))
        if files:
            found.append(files[0])
        else:
            missing.append(spec)
    return found, missing


def install(group: str) -> dict:
    """PYTHONPATH for a row that needs `group`: meshlm's src, then its wheels installed from .whl alone."""
    target = INSTALLED / group
    if not target.exists():
        files, _ = wheel_files(group)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--no-cache-dir", "--target", str(target), *map(str, files)], check=True)
    return {"PYTHONPATH": os.pathsep.join([ENV["PYTHONPATH"], str(target)])}


def machine() -> dict:
    import transformers

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info = {"gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda}
    return info | {"transformers": transformers.__version__, "python": platform.python_version()}


def report(results: list[dict], info: dict, out: Path) -> None:
    """gpu-check.json and gpu-check.md, each replaced whole (a kill mid-write leaves the previous one)."""
    counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "FAIL", "cut", "not run")}
    lines = [
        f"## make gpu-check: {len(info['gpus'])} x {', '.join(sorted(set(info['gpus']))) or 'no GPU'}",
        "",
        (
            f"torch {info['torch']} (CUDA {info['cuda']}), transformers {info['transformers']}, python "
            f"{info['python']}; " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" of {len(results)}."
        ),
        "",
        "| check | result | detail | s |",
        "|---|---|---|---:|",
    ]
    lines += [f"| {r['check']} | {r['status']} | {r['detail'].replace('|', '/')} | {r['seconds']} |" for r in results]
    for name, text in (
        ("gpu-check.json", json.dumps({"machine": info, "results": results}, indent=1, default=str) + "\n"),
        ("gpu-check.md", "\n".join(lines) + "\n"),
    ):
        (out / f".{name}").write_text(text)
        (out / f".{name}").replace(out / name)


def choose(rows: list, gpus: int, everything: bool, only: str) -> list:
    """The rows this command runs: by name (substrings), all, or the first-lease and spare rows."""
    if only:
        return [r for r in rows if r.gpus <= gpus and any(s in r.name for s in only.split(","))]
    return [r for r in rows if r.gpus <= gpus and (everything or r.lease != "later")]


def dry_run(todo: list, deadline: float, choice: str) -> None:
    """The rows with their estimates, the total against the deadline, and the one device command."""
    print(
        f"gpu-check --dry-run: {len(todo)} rows, in this order (estimates: benchmarks/gpu_check_jobs.py's allowances)"
    )
    groups = sorted({r.wheels for r in todo if r.wheels})
    for r in todo:
        wheels = f" + {INSTALL_S} s installing {r.wheels}" if r.wheels else ""
        print(f"  {r.seconds:5.0f} s{wheels:<28} {r.lease:<6} {r.name}")
    first = [r for r in todo if r.lease == "first"]
    total = sum(r.seconds for r in first) + INSTALL_S * len({r.wheels for r in first if r.wheels})
    print(f"first-lease set: {total:.0f} s of the {deadline:.0f} s deadline; the other rows run while time is left")
    size = 0
    for group in groups:
        files, missing = wheel_files(group)
        size += sum(f.stat().st_size for f in files)
        print(
            f"wheels {group}: {', '.join(f.name for f in files) or '-'}" + (f"; MISSING {missing}" if missing else "")
        )
    print(
        f"wheels to carry: {size / 2**20:.1f} MiB in .whl/ of {WHEEL_BUDGET / 2**20:.0f} (make gpu-wheels fetches them)"
    )
    command = f"PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --deadline {deadline:.0f}{choice}"
    print(f'device command: run(command="{command}", carry=[".whl"], timeout_s=600)')


def download_wheels() -> int:
    """Every WHEELS requirement for the lent machine's Python 3.12 on x86-64 into .whl/, and their total size
    (exit 1 over the budget)."""
    platforms = [f"--platform=manylinux{p}_x86_64" for p in ("_2_28", "_2_27", "_2_24", "_2_17", "2014", "1")]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version=3.12"]
    specs = [spec for group in WHEELS.values() for spec in group]
    subprocess.run([*cmd, "--implementation=cp", *platforms, "-d", str(WHEEL_DIR), *specs], check=True)
    files = [f for group in WHEELS for f in wheel_files(group)[0]]
    size = sum(f.stat().st_size for f in files)
    print(f"gpu-wheels: {len(files)} wheels, {size / 2**20:.1f} MiB in {WHEEL_DIR} (budget {WHEEL_BUDGET / 2**20:.0f})")
    return 0 if size <= WHEEL_BUDGET else 1


def run_rows(todo: list, out: Path, end: float, info: dict) -> list[dict]:
    """Each row in turn while its estimate fits before `end` (time.monotonic()); the report rewritten after each."""
    lacking = {g: wheel_files(g)[1] for g in {r.wheels for r in todo if r.wheels}}
    for missing in filter(None, lacking.values()):
        print(f"gpu-check: .whl/ lacks {', '.join(missing)}: run `make gpu-wheels` here first; its rows are not run")
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for i, row in enumerate(todo):
            left = end - time.monotonic()
            cost = row.seconds + (INSTALL_S if row.wheels and not (INSTALLED / row.wheels).exists() else 0)
            if row.wheels and lacking[row.wheels]:
                result = {"check": row.name, "status": "not run", "detail": f"no wheel for {lacking[row.wheels][0]}"}
            elif cost > left:
                result = {
                    "check": row.name,
                    "status": "not run",
                    "detail": f"estimated {cost:.0f} s, {left:.0f} s left",
                }
            else:
                env = install(row.wheels) if row.wheels else None
                result = run_row(row.name, row.check, Path(tmp, str(i)), end - time.monotonic(), env)
            results.append({"seconds": 0, **result})
            gpu_check_rows.earlier[row.name] = result
            print(f"{result['status'].upper():<8} {row.name}: {result['detail']}", flush=True)
            report(results, info, out)
    return results


def machine_in_fork() -> dict:
    """machine() in a forked process: the driver itself never initializes CUDA, which its forked rows could not
    use after it."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=lambda: send.send(machine()))
    proc.start()
    proc.join(120)  # its answer is a few names: the pipe holds it until read
    info = recv.recv() if recv.poll() else {"gpus": [], "torch": torch.__version__, "cuda": "?"}
    proc.kill()  # where it hangs; a no-op once it has ended
    return {"transformers": "?", "python": platform.python_version(), **info}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="where the report goes [$OUT, else .]")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S, help=f"seconds to finish within [{DEADLINE_S}]")
    ap.add_argument(
        "--all", action="store_true", help="every row this machine's GPUs allow, not only the first lease's"
    )
    ap.add_argument("--only", default="", help="comma-separated row names (substrings) to run")
    ap.add_argument("--dry-run", action="store_true", help="print the rows, their estimates and the device command")
    ap.add_argument("--download-wheels", action="store_true", help="fetch the wheels the GPU machine lacks into .whl")
    args = ap.parse_args(argv)
    if args.download_wheels:
        return download_wheels()
    gpus = torch.cuda.device_count() if torch is not None else 0
    todo = choose(gpu_check_rows.rows(), max(gpus, 1), args.all, args.only)
    if args.dry_run:
        dry_run(todo, args.deadline, " --all" if args.all else f" --only '{args.only}'" if args.only else "")
        return 0
    if not gpus:  # counted through NVML: torch.cuda.is_available() would initialize CUDA, which forks cannot use
        where = (
            f"torch {torch.__version__}, CUDA build {torch.version.cuda}" if torch else f"{sys.executable} has no torch"
        )
        print(f"gpu-check: no CUDA GPU visible ({where}); nothing to check here, run it on a GPU machine")
        return 0
    os.environ["PYTHONPATH"] = ENV["PYTHONPATH"]  # the runs that harness.py starts read os.environ
    harness.ENV["PYTHONPATH"] = ENV["PYTHONPATH"]
    end = time.monotonic() + args.deadline
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {gpus} GPU(s), {len(todo)} rows, deadline {args.deadline:.0f} s; reports in {out}", flush=True)
    results = run_rows(todo, out, end, machine_in_fork())
    failed = sum(r["status"] == "FAIL" for r in results)
    print(f"gpu-check: {failed} failed of {len(results)}; wrote {out / 'gpu-check.md'} and {out / 'gpu-check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
