"""verify's and plan --validate's runs (train_child.py): a child forked from a process that imported the trainer
exits, prints and trains as `python -m meshlm train` started as a new interpreter does, for a run and for bad
input found before and after the run directory is opened."""

from __future__ import annotations

import json
import os
import sys

from conftest import TINY, run_python

SCRIPT = """
import json, subprocess, sys, threading
from meshlm import train_child

argv, out = json.loads(sys.argv[1]), sys.argv[2]
assert threading.active_count() == 1  # the fork, not the new interpreter train_child falls back to
forked = train_child.run([*argv, "--output-dir", out + "/forked"])
fresh = [sys.executable, "-m", "meshlm", "train", *argv, "--output-dir", out + "/fresh"]
fresh = subprocess.run(fresh, capture_output=True, text=True)
runs = [[p.returncode, p.stdout.replace(out + "/" + n, "OUT"), p.stderr.replace(out + "/" + n, "OUT")]
        for p, n in ((forked, "forked"), (fresh, "fresh"))]
print(json.dumps(runs))
"""


def _both(tmp_path, name: str, *args: str) -> list:
    script = tmp_path / "both.py"
    script.write_text(SCRIPT)
    argv = [*TINY, "--max-steps", "2", *args]
    cmd = [sys.executable, str(script), json.dumps(argv), str(tmp_path / name)]
    p = run_python(cmd, env={**os.environ}, timeout=600, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    forked, fresh = json.loads(p.stdout.splitlines()[-1])
    return forked, fresh


def test_a_forked_run_trains_and_prints_as_a_new_interpreter(tmp_path):
    forked, fresh = _both(tmp_path, "run", "--save-final", "false")
    assert forked[0] == fresh[0] == 0
    shown = [
        [ln for ln in run[1].splitlines() if "tokens/s" not in ln and not ln.startswith("tokenising")]
        for run in (forked, fresh)
    ]
    assert shown[0] == shown[1]  # (the first fills the token cache)
    assert forked[2] == fresh[2]


def test_bad_input_gives_the_same_line_and_status(tmp_path):
    for args in (["--max-steps", "0"], ["--no-such-option", "1"], ["--parallel.tp", "3"]):
        forked, fresh = _both(tmp_path, "bad", *args)
        assert forked == fresh and forked[0] == 2 and forked[2].startswith("meshlm: error:"), (args, forked, fresh)
