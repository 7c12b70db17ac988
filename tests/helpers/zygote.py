"""A process that has imported meshlm's command line and trainer once, and forks one child per `meshlm ARGS` a
test runs (conftest.run_meshlm), so that a launch does not pay ~5 CPU-s importing torch and transformers again.

Each child is a real process of its own, with the test's environment, working directory and arguments, its
stdout and stderr in files, and `python -m meshlm`'s exit status (a signal's death as -N), as subprocess.run
reports it. What a fresh interpreter would do differently happens before the fork: imports (whose output this
process checks is empty, so noise at import still fails a test: see `main`), and what the C library and OpenMP
read from the environment when they load, which is why conftest starts a fresh interpreter instead when a test
sets an import-time variable (PYTHONPATH, MALLOC_*, LD_*).

A request may name a "script" instead: the child is then `python SCRIPT ARGV` (tests/helpers/family_runs.py).

Protocol, one JSON line each way: {"argv", "env", "cwd", "stdout", "stderr"[, "script"]} in; {"pid"} at the fork, then
{"status", "cpu"} when the child has ended (`cpu`: its user + system seconds with its own waited-for children's).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback

PRELOAD = ("meshlm.cli", "meshlm.cli.train", "meshlm.train.trainer", "meshlm.launch")


def _exit_code(e: SystemExit) -> int:
    """What the interpreter makes of a SystemExit that reaches it: None -> 0, an int as is, else printed, 1."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _as_fresh() -> None:
    """What a fresh interpreter starts with that a fork inherits instead: random generators seeded from the
    system (a port or temporary name drawn by each child must differ), and OpenMP's thread count."""
    import random

    import torch

    sys.path[0] = os.getcwd()  # `python -m` looks for modules in the working directory first
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))


def _child(request: dict) -> None:
    """Become `python -m meshlm ARGV` as the test asked, then leave as the interpreter would (exit functions
    run, streams flushed), without returning into the parent's loop."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _as_fresh()
        script = request.get("script")
        sys.argv = [script or "meshlm", *request["argv"]]
        if script:  # `python SCRIPT` looks for modules next to the script first
            sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            if script:
                runpy.run_path(script, run_name="__main__")
            else:
                runpy.run_module("meshlm", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 130
        except BaseException:  # noqa: BLE001 - the interpreter prints any uncaught exception and exits 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        from meshlm.runtime import exit_flushed  # loaded already (PRELOAD)

        exit_flushed(code)


def _serve(requests, replies) -> None:
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status, usage = os.wait4(pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status), "cpu": cpu}) + "\n")
        replies.flush()


def main() -> None:
    """Import PRELOAD with fd 1 and 2 pointing at a file, report what was printed there (conftest fails the
    launch if anything was: a fresh `python -m meshlm` would have shown it), then serve requests on the
    pipes it was started with, which move off fd 0 and 1 so that a child's redirections leave them alone."""
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    noise_path = os.environ["MESHLM_ZYGOTE_NOISE"]
    with open(noise_path, "w") as noise:
        os.dup2(noise.fileno(), 1)
        os.dup2(noise.fileno(), 2)
    for name in PRELOAD:
        __import__(name)
    sys.stdout.flush()
    sys.stderr.flush()
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    _serve(requests, replies)


if __name__ == "__main__":
    main()
