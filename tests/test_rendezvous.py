"""Multi-node rendezvous with real launchers on 127.0.0.1: nodes meet without --rdzv-id, and a rendezvous
that cannot complete fails within --rdzv-timeout with one line naming the nodes that joined and those
that did not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import TINY

pytestmark = pytest.mark.slow

ARGS = [*TINY, "--max-steps", "2", "--micro-batch-size", "4", "--save-final", "false"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, port: int, out, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "meshlm",
        "train",
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        *extra,
        *ARGS,
        "--output-dir",
        str(out),
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def test_two_launchers_without_rdzv_id_meet(tmp_path):
    """What `meshlm train --help` asks for, on two "nodes", no --rdzv-id: they used to draw two random ids
    and wait for each other for ever."""
    port = _free_port()
    nodes = [_node(r, port, tmp_path / "run", "--rdzv-timeout", "300") for r in (0, 1)]
    outs = [n.communicate(timeout=400) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert "x 2 data-parallel ranks" in outs[0][0]


def test_incomplete_rendezvous_fails_within_the_bound(tmp_path):
    """Node 0 without node 1, and node 1 without node 0 (each on its own port), --rdzv-timeout 5: both
    stop with exit 2 and one line saying who joined; well before any default timeout (600 s)."""
    only0, only1 = _free_port(), _free_port()
    t0 = time.monotonic()
    nodes = [
        _node(0, only0, tmp_path / "a", "--rdzv-timeout", "5"),
        _node(1, only1, tmp_path / "b", "--rdzv-timeout", "5"),
    ]
    outs = [n.communicate(timeout=300) for n in nodes]
    elapsed = time.monotonic() - t0
    assert [n.returncode for n in nodes] == [2, 2], outs
    last = [err.strip().splitlines()[-1] for _, err in outs]
    assert last[0].startswith("meshlm: error: rendezvous at 127.0.0.1") and "within --rdzv-timeout 5 s" in last[0]
    assert "node(s) 0 joined, node(s) 1 did not" in last[0], last[0]
    assert "no answer from node 0" in last[1], last[1]
    assert elapsed < 200, elapsed  # 5 s bounds plus interpreter starts on a loaded machine; never 600 s
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
