"""run_meshlm's zygote (tests/helpers/zygote.py) stands in for `python -m meshlm` in a new interpreter: the same
output, exit status, working directory and environment, and a new interpreter where the environment differs in
what is read at start-up."""

from __future__ import annotations

import conftest
from conftest import TINY, run_meshlm


def test_a_forked_launch_prints_and_exits_as_a_fresh_one(tmp_path):
    args = ["train", "--max-steps", "-3", "--output-dir", "run"]
    forked = run_meshlm(*args, check=False, cwd=tmp_path, env={"MESHLM_CACHE": str(tmp_path / "cache")})
    assert conftest._ZYGOTE and conftest._ZYGOTE[0].usable and conftest._ZYGOTE[0].count >= 1
    fresh = run_meshlm(*args, check=False, cwd=tmp_path, env={"MESHLM_CACHE": str(tmp_path / "cache")}, fresh=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and forked.stderr.startswith("meshlm: error: "), forked.stderr


def test_the_child_runs_where_and_with_what_it_was_asked(tmp_path):
    """A relative --output-dir lands in the test's working directory and the token cache where the test's
    MESHLM_CACHE says; a start-up variable of its own (HF_HUB_OFFLINE, which huggingface_hub reads at import)
    gets a new interpreter instead, which the zygote's count shows."""
    runs = conftest._zygote().count
    run_meshlm("train", *TINY, "--max-steps", "1", "--output-dir", "run", cwd=tmp_path, env={"MESHLM_CACHE": "c"})
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "c").is_dir()
    assert conftest._zygote().count == runs + 1
    run_meshlm("env", env={"HF_HUB_OFFLINE": "1"})
    assert conftest._zygote().count == runs + 1
