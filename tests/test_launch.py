"""Launching beyond one node: two launchers as two "nodes" on loopback, the plain torchrun form, what listens
where, and the Slurm script."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, assert_close, losses, run_meshlm
from meshlm import cli

pytestmark = pytest.mark.slow

ARGS = [*TINY, "--max-steps", "6", "--micro-batch-size", "2", "--save-final", "false"]  # 4 ranks x 2 = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(root: int) -> set[int]:
    """root and all its descendants, from /proc."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by these processes."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            found.add((addr, int(hex_port, 16)))
    return found


def _watch(proc: subprocess.Popen, seen: set, timeout: float = 600) -> None:
    """Wait for proc, collecting what its process tree listens on meanwhile."""
    end = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < end:
        seen |= _listening(_tree(proc.pid))
        time.sleep(0.2)


def _popen(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def test_ranks_forked_from_a_launcher_that_imported_the_trainer_train_as_a_fork_servers(tmp_path):
    """A launcher that has imported the trainer with one thread (a fork of the suite's zygote) forks its ranks
    itself (launch.start_method); a new interpreter's launcher starts a fork server. Both ranks' modules say
    which happened, and the two runs print and train the same."""
    job = [*TINY, "--nproc", "2", "--strategy", "zero3", "--max-steps", "3"]
    runs = {}
    for name, fresh in (("forked", False), ("server", True)):
        trace = tmp_path / f"trace-{name}"
        trace.mkdir()
        p = run_meshlm(
            "train", *job, "--output-dir", tmp_path / name, env={"MESHLM_RANK_TRACE": str(trace)}, fresh=fresh
        )
        modules = json.loads((trace / "rank-1.json").read_text())["modules"]
        assert ("meshlm.launch" in modules) == (name == "forked"), name  # the launcher's own modules, inherited
        # the first of the two fills the token cache
        lines = p.stdout.replace(str(tmp_path / name), "OUT").splitlines()
        shown = [line for line in lines if not line.startswith("tokenising") and "tokens/s" not in line]
        runs[name] = shown, p.stderr
    assert runs["forked"] == runs["server"]
    rows = {n: [json.loads(r) for r in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    for got, want in zip(rows["forked"], rows["server"], strict=True):
        assert (got.get("loss"), got.get("grad_norm")) == (want.get("loss"), want.get("grad_norm"))


def test_two_nodes_on_loopback_match_one_node(tmp_path):
    """Node 0: `meshlm train --nnodes 2`; node 1: plain `torchrun --nnodes 2 -m meshlm train`; 2 ranks each,
    rendezvousing on 127.0.0.1. Same losses as the job on 4 ranks of one node (rtol 1e-6: the same
    reductions in the same rank order). meshlm's launchers and ranks listen on 127.0.0.1 only."""
    port, multi, single = _free_port(), tmp_path / "multi", tmp_path / "single"
    node0 = _popen(
        [
            sys.executable,
            "-m",
            "meshlm",
            "train",
            "--nproc",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "two-nodes",
            *ARGS,
            "--output-dir",
            str(multi),
        ]
    )
    node1 = _popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "two-nodes",
            "--rdzv-conf",
            "is_host=0",
            "--local-addr",
            "127.0.0.1",
            "-m",
            "meshlm",
            "train",
            *ARGS,
            "--output-dir",
            str(multi),
        ],
        env={"GLOO_SOCKET_IFNAME": "lo"},
    )
    seen_multi: set = set()
    _watch(node0, seen_multi)
    node1.wait(timeout=120)
    out0, out1 = node0.stdout.read(), node1.stdout.read()
    assert node0.returncode == 0 and node1.returncode == 0, f"node 0:\n{out0[-3000:]}\nnode 1:\n{out1[-3000:]}"
    assert "x 4 data-parallel ranks" in out0 + out1

    ref = _popen([sys.executable, "-m", "meshlm", "train", "--nproc", "4", *ARGS, "--output-dir", str(single)])
    seen_single: set = set()
    _watch(ref, seen_single)
    assert ref.returncode == 0, ref.stdout.read()[-3000:]

    assert_close(losses(multi), losses(single), rtol=1e-6)
    assert len(losses(multi)) == 6
    assert ("127.0.0.1", port) in seen_multi  # the rendezvous store, on the address it was given
    assert seen_multi and {addr for addr, _ in seen_multi} == {"127.0.0.1"}, seen_multi
    assert seen_single and {addr for addr, _ in seen_single} == {"127.0.0.1"}, seen_single


# ---------------------------------------------------------------- Slurm

SHIM_SRUN = """\
import os, subprocess, sys
argv = sys.argv[1:]
if "hostname" in argv:  # the head node's address
    print("10.1.2.3 10.9.9.9")
    sys.exit(0)
i = 0
while argv[i].startswith("--"):  # the script passes every srun option as --key=value
    i += 1
nodes = int(next(a.split("=", 1)[1] for a in argv[:i] if a.startswith("--nodes=")))
for n in range(nodes):
    subprocess.run(argv[i:], env={**os.environ, "SLURM_NODEID": str(n)}, check=True)
"""
SHIM_PYTHON = """\
import json, os, sys
with open(os.path.join(os.environ["RECORD"], "node-" + os.environ["SLURM_NODEID"] + ".json"), "w") as f:
    json.dump(sys.argv[1:], f)
"""


def test_slurm_script(tmp_path, monkeypatch, capsys):
    """The script's directives, `bash -n`, and a dry run with stand-ins for srun/scontrol: each node's launcher
    gets its node rank, the first node's address as rendezvous and the training arguments unchanged."""
    monkeypatch.chdir(tmp_path)
    train = [
        "--max-steps",
        "1000",
        "--experiment-name",
        "run 1",
        "--wandb-project",
        "it's $HOME `x`",
        "--lr",
        "1e-4",
        "--output-dir",
        "runs/a b",
    ]
    with pytest.raises(SystemExit) as e:
        cli.main(
            [
                "slurm",
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "--time",
                "04:00:00",
                "--partition",
                "gpu-p",
                "--script",
                "job.sbatch",
                "--",
                "train",
                *train,
            ]
        )
    assert e.value.code == 0
    assert "sbatch job.sbatch" in capsys.readouterr().out
    script = (tmp_path / "job.sbatch").read_text()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=gpu-p",
        f"#SBATCH --chdir={tmp_path}",
    ):
        assert line in script.splitlines(), line
    assert "--error=" in script and "scontrol show hostnames" in script
    subprocess.run(["bash", "-n", "job.sbatch"], check=True)

    shims, record = tmp_path / "shims", tmp_path / "record"
    shims.mkdir()
    record.mkdir()
    for name, body in (("srun", SHIM_SRUN), ("fake-python", SHIM_PYTHON)):
        (shims / name).write_text(f"#!{sys.executable}\n{body}")
        (shims / name).chmod(0o755)
    (shims / "scontrol").write_text("#!/bin/bash\nprintf 'node001\\nnode002\\nnode003\\nnode004\\n'\n")
    (shims / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[001-004]",
        "SLURM_JOB_ID": "777",
        "SLURM_CPUS_ON_NODE": "64",
        "MESHLM_PYTHON": str(shims / "fake-python"),
        "RECORD": str(record),
    }
    p = subprocess.run(["bash", "job.sbatch"], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for node in range(4):
        argv = json.loads((record / f"node-{node}.json").read_text())
        assert argv == [
            "-m",
            "meshlm",
            "train",
            "--nnodes",
            "4",
            "--nproc",
            "8",
            "--node-rank",
            str(node),
            "--rdzv-endpoint",
            "10.1.2.3:29400",
            "--rdzv-id",
            "meshlm-777",
            "--max-restarts",
            "3",
            *train,
        ], argv
    assert (tmp_path / "runs" / "a b" / "logs" / "slurm-777").is_dir()  # per-node out/err files go there


def test_rendezvous_refuses_an_address_that_is_not_ours(tmp_path, monkeypatch, capsys):
    """--node-rank 0 hosts the rendezvous; on an address this machine does not have, one line, exit 2."""
    for var in ("MESHLM_LAUNCHED", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"):  # launch() sets them
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(
            [
                "train",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                "192.0.2.1:29400",
                *TINY,
                "--output-dir",
                str(tmp_path / "out"),
            ]
        )
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("meshlm: error: rendezvous at 192.0.2.1:29400 failed"), err
    assert not (tmp_path / "out").exists()
