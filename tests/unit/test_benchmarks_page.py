"""BENCHMARKS.md is what benchmarks/render.py makes of benchmarks/results/: the page is never edited by hand, and it
opens with the current number of every claim, each with the command that reproduces it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rendered() -> str:
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "render.py"), "--stdout"], capture_output=True, text=True, check=True
    )
    return p.stdout


def test_the_committed_page_is_what_the_results_render():
    assert (ROOT / "BENCHMARKS.md").read_text() == rendered(), "run `python benchmarks/render.py` and commit"


def test_the_page_opens_with_the_current_numbers_each_with_its_command():
    head = (ROOT / "BENCHMARKS.md").read_text().splitlines()[:60]
    assert "## Current numbers" in head
    rows = [ln for ln in head[head.index("## Current numbers") + 3 :] if ln.startswith("| [")]
    assert len(rows) >= 20
    for row in rows:
        assert row.rstrip(" |").endswith("`") and "`" in row.split(" | ")[-1], row
