"""meshlm's own packaging builds without a deprecation warning (what `pip install -e .` prints on every install)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_building_the_metadata_warns_of_nothing(tmp_path):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (tmp_path / "meta").mkdir()
    build = "from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel('meta')"
    p = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "deprecat" not in (p.stdout + p.stderr).lower(), p.stdout + p.stderr
    metadata = next((tmp_path / "meta").glob("*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in metadata.read_text()
