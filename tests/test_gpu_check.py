"""`make gpu-check` where there is no GPU, and meshlm without the `datasets` package (GPU machines
that run gpu-check may not have it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import TINY

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(
        ["make", "-s", "gpu-check", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU visible"), p.stdout
    assert not (ROOT / "gpu-check.md").exists()  # nothing ran, nothing reported


BLOCK_DATASETS = textwrap.dedent("""
    import importlib.abc, sys

    class NoDatasets(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "datasets" or name.startswith("datasets."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoDatasets())
    import meshlm.cli, meshlm.train.trainer, meshlm.infer.generate, meshlm.verify, meshlm.plan.cli  # noqa: E401
    from meshlm.cli import main
    try:
        main(sys.argv[1:])
    finally:
        assert "datasets" not in sys.modules
""")


def test_meshlm_trains_without_datasets(tmp_path):
    """Import every command and train the built-in job with `datasets` unimportable."""
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCK_DATASETS,
            "train",
            *TINY,
            "--max-steps",
            "2",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "COMPLETE").is_file()
