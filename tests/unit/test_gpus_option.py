"""--gpus for train and generate: the CUDA_VISIBLE_DEVICES value the ranks get (indices into the GPUs this process
sees, one per rank), and one line for anything else, on CPU too (no GPU to choose)."""

from __future__ import annotations

import pytest

from conftest import run_meshlm
from meshlm.errors import MeshlmError
from meshlm.options import strip_launch_flags, visible_gpus


@pytest.mark.parametrize(
    "spec, nproc, visible, want",
    [
        ("0", None, ["0", "1"], "0"),
        ("1", None, ["0", "1"], "1"),
        ("2,0", 2, ["0", "1", "2", "3"], "2,0"),
        ("0,1", 2, ["4", "6", "7"], "4,6"),  # under CUDA_VISIBLE_DEVICES=4,6,7: indices into what it shows
        ("1", 1, ["GPU-aa", "GPU-bb"], "GPU-bb"),
    ],
)
def test_the_ranks_see_the_gpus_chosen(spec, nproc, visible, want):
    assert visible_gpus(spec, nproc, visible) == want


@pytest.mark.parametrize(
    "spec, nproc, visible, error",
    [
        ("0,1", 2, [], "no CUDA GPU is visible here (CPU ranks); drop --gpus"),
        ("a,b", 2, ["0", "1"], "needs GPU indices separated by commas"),
        ("-1", None, ["0"], "needs GPU indices separated by commas"),
        ("0,0", 2, ["0", "1"], "names a GPU twice"),
        ("0,2", 2, ["0", "1"], "GPU 2 is not there; this machine shows 2 GPU(s), 0 to 1"),
        ("0,1", None, ["0", "1"], "names 2 GPU(s) for 1 rank(s): one per rank; add --nproc 2"),
        ("0", 2, ["0", "1"], "names 1 GPU(s) for 2 rank(s): one per rank; --nproc 1"),
    ],
)
def test_a_wrong_choice_is_one_line(spec, nproc, visible, error):
    with pytest.raises(MeshlmError, match=error.replace("(", r"\(").replace(")", r"\)")):
        visible_gpus(spec, nproc, visible)


def test_the_ranks_are_not_passed_the_flag():
    assert strip_launch_flags(["--gpus", "0,1", "--nproc", "2", "--max-steps", "3"]) == ["--max-steps", "3"]
    assert strip_launch_flags(["--gpus=0,1", "--lr", "1e-3"]) == ["--lr", "1e-3"]


@pytest.mark.parametrize("command", [["train", "--nproc", "2"], ["generate", "--model-name", "x", "--nproc", "2"]])
def test_on_cpu_the_flag_is_refused_before_anything_starts(command, tmp_path):
    p = run_meshlm(
        *command,
        "--gpus",
        "0,1",
        "--output-dir" if command[0] == "train" else "--out",
        tmp_path / "o",
        check=False,
        cwd=tmp_path,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and lines == [
        "meshlm: error: --gpus 0,1 chooses GPUs, and no CUDA GPU is visible here (CPU ranks); drop --gpus"
    ], p.stderr
    assert not (tmp_path / "o").exists()
