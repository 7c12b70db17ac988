"""`meshlm train ARGV` as a child process of this one, for commands that run many trainings (verify's layouts,
plan --validate's): its exit status, stdout and stderr, as `subprocess.run` reports them.

On CPU the child is forked from this process once it has imported the trainer: a new interpreter per run would
import torch and transformers again (~5 CPU-s a run), and the child's own launcher then forks its ranks from
itself too (launch.start_method). It is a process of its own all the same: its environment, standard streams
in files, `python -m meshlm`'s exit status. Where the launcher would not fork its ranks from this process
(launch.start_method: CUDA devices, other threads, standard streams that are not its own), each run is a new
interpreter, as before.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path


def run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m meshlm train ARGV` with `env` (this process's when None)."""
    cmd = [sys.executable, "-m", "meshlm", "train", *argv]
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    import meshlm.train.trainer  # noqa: F401 - imported once here, inherited by every child
    from meshlm.launch import start_method

    if start_method() != "fork":  # the launcher's own test of this process: CUDA, other threads, captured streams
        return subprocess.run(cmd, capture_output=True, text=True, env=env)

    with tempfile.TemporaryDirectory(prefix="meshlm-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, env, out, err)
        _, status = os.waitpid(pid, 0)
        return subprocess.CompletedProcess(
            cmd, os.waitstatus_to_exitcode(status), out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def _child(argv: list[str], env: dict, out: Path, err: Path) -> None:
    """Become `meshlm train ARGV`, then leave with its status and its streams flushed, never returning into the
    parent's code, nor running the parent's exit functions (one removes the parent's temporary directory)."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ.clear()
        os.environ.update(env)
        random.seed()  # a port or temporary name the child draws must differ from its siblings'
        from meshlm import cli

        try:
            cli.main(["train", *argv])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception, status 1
            traceback.print_exc()
    finally:
        from meshlm.runtime import exit_flushed  # loaded already, with the trainer

        exit_flushed(code)
