"""A rank of `meshlm train --nproc 2 --strategy zero3 --parallel.tp 2` imports what trains and checks the job once.
Every rank writes its own sys.modules and the calls it made (MESHLM_RANK_TRACE, rank_trace.py); the launcher is
this process, its calls counted the same way."""

from __future__ import annotations

import json
import sys

from conftest import TINY
from meshlm import cli, launch, rank_trace

JOB = ["--nproc", "2", "--strategy", "zero3", "--parallel.tp", "2", "--max-steps", "1"]
# The meshlm modules a training rank holds (rank_trace, the measuring aid, not counted). What trains is the
# rest; the planner, the other commands and the launcher are left out.
MOST_MODULES = 50
CHECK_TP = "meshlm.parallel.tensor.check_tp"
MODEL_CONFIG = "meshlm.models.build.model_config"


def test_a_training_rank_imports_no_planner_and_checks_once(tmp_path, monkeypatch):
    trace = tmp_path / "trace"
    trace.mkdir()
    # the command line's launcher: ranks forked from this process, which imported everything, would hold it all
    monkeypatch.setattr(launch, "start_method", lambda: "forkserver")
    monkeypatch.setenv(rank_trace.VARIABLE, str(trace))
    calls = rank_trace.start()
    try:
        status = cli.run(["train", *TINY, *JOB, "--output-dir", str(tmp_path / "run")])
    finally:
        sys.setprofile(None)
    assert status == 0
    assert calls[CHECK_TP] == 1  # the launcher's check of the job
    for rank in (0, 1):
        record = json.loads((trace / f"rank-{rank}.json").read_text())
        modules = [m for m in record["modules"] if m != "meshlm.rank_trace"]
        assert "meshlm.train.trainer" in modules and "meshlm.parallel.tensor" in modules  # it trained with tp
        assert not [m for m in modules if m.startswith(("meshlm.plan", "meshlm.launch", "meshlm.slurm"))], modules
        assert not [m for m in modules if m.startswith("meshlm.cli.") and m != "meshlm.cli.train"], modules
        assert len(modules) <= MOST_MODULES, modules
        assert (record["calls"].get(CHECK_TP), record["calls"].get(MODEL_CONFIG)) == (1, 1), rank
