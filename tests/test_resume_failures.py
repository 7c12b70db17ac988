"""Real multi-process checks of failures that used to be misreported or wait for a timeout: a rank that
fails while resuming (not a corrupt checkpoint), a really damaged checkpoint, and rank-0-first work that
outlasts --dist-timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TINY, run_meshlm

pytestmark = pytest.mark.slow

ARGS = [*TINY, "--strategy", "zero3", "--micro-batch-size", "4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "run"
    run_meshlm("train", "--nproc", "2", *ARGS, "--max-steps", "2", "--output-dir", out)
    return out


def test_a_rank_failing_to_load_is_not_called_corrupt(run, tmp_path):
    """Rank 1 raises while resuming (MESHLM_FAIL_IN_LOAD, as an out-of-memory error would): exit 1 with its
    traceback, not the exit-2 "corrupt" line, and rank 0 stops at once instead of waiting --dist-timeout."""
    out = shutil.copytree(run, tmp_path / "run")
    t0 = time.monotonic()
    p = run_meshlm(
        "train",
        "--nproc",
        "2",
        *ARGS,
        "--max-steps",
        "3",
        "--dist-timeout",
        "600",
        "--output-dir",
        out,
        env={"MESHLM_FAIL_IN_LOAD": "1"},
        check=False,
    )
    elapsed = time.monotonic() - t0
    assert p.returncode == 1, p.stderr
    assert "rank 1 failed" in p.stderr and "injected fault while loading" in p.stderr, p.stderr
    assert "Traceback" in p.stderr and "corrupt" not in p.stderr, p.stderr
    assert elapsed < 300, elapsed  # far below the 600 s collective timeout


def test_a_truncated_shard_is_corrupt(run, tmp_path):
    out = shutil.copytree(run, tmp_path / "run")
    shard = out / "checkpoints" / "step-2" / "state" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    p = run_meshlm("train", "--nproc", "2", *ARGS, "--max-steps", "3", "--output-dir", out, check=False)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "is damaged" in lines[0] and "__1_0.distcp has 100 bytes" in lines[0], lines[0]  # its manifest says so


RANK0_FIRST = textwrap.dedent("""
    import sys, time
    from meshlm import runtime
    rt = runtime.init("gloo", timeout_s=3)
    t0 = time.monotonic()
    try:
        with runtime.rank0_first(what="the test's work"):
            if rt.rank == 0:
                time.sleep(8)  # longer than the 3 s collective timeout
                if sys.argv[1] == "fail":
                    raise ValueError("rank 0's work failed")
        runtime.barrier()  # the next collective, as in training (rank 0 hosts the store here)
    except Exception as e:
        print(f"rank {rt.rank}: {type(e).__name__}: {e}", flush=True)
        time.sleep(2)  # rank 0 hosts the store: a failed rank lives on while its launcher collects it
        sys.exit(3)
    finally:
        runtime.shutdown()
    print(f"rank {rt.rank} done after {time.monotonic() - t0:.1f} s", flush=True)
""")


def _two_ranks(mode: str, port: int) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK0_FIRST, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for r in (0, 1)
    ]
    return [(p, p.communicate(timeout=120)[0]) for p in procs]


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_rank0_first_outlasts_the_collective_timeout(mode):
    """Rank 0 works 8 s under a 3 s --dist-timeout: rank 1 waits for it (a barrier would have failed at 3 s),
    and when rank 0's work fails, rank 1 stops right away saying so."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (p0, out0), (p1, out1) = _two_ranks(mode, port)
    if mode == "ok":
        assert p0.returncode == p1.returncode == 0, out0 + out1
        assert "rank 1 done" in out1
    else:
        assert p0.returncode == p1.returncode == 3, out0 + out1
        assert "rank 0: ValueError: rank 0's work failed" in out0
        assert "rank 1: RuntimeError: rank 0 failed during the test's work" in out1, out1
