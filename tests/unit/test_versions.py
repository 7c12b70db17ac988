"""The supported range of torch and transformers (meshlm/versions.py): `meshlm env` says where the installed
releases stand, and every other command refuses an older one in one line before it writes anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run_meshlm
from meshlm import versions
from meshlm.errors import MeshlmError

SRC = Path(__file__).resolve().parents[2] / "src"


def _installed(monkeypatch, **found: str) -> None:
    monkeypatch.setattr(versions, "installed", lambda package: found.get(package, versions.NEWEST[package]))


def test_standing_against_the_range(monkeypatch):
    _installed(monkeypatch, torch="2.13.0+cpu", transformers="5.24.1")
    assert versions.standing("torch") == "inside the tested range, 2.11.0 to 2.15.x"  # the build tag aside
    assert versions.standing("transformers") == "inside the tested range, 5.17.0 to 5.24.x"  # a patch release
    _installed(monkeypatch, torch="2.10.1", transformers="5.25.0")
    assert versions.standing("torch") == "older than the tested range, 2.11.0 to 2.15.x"
    assert versions.standing("transformers") == "newer than the tested range, 5.17.0 to 5.24.x"


def test_an_older_release_is_refused_and_a_newer_one_runs(monkeypatch):
    _installed(monkeypatch, transformers="5.16.1")
    with pytest.raises(MeshlmError, match=r"^meshlm needs transformers >= 5\.17\.0; found transformers 5\.16\.1"):
        versions.check()
    _installed(monkeypatch, torch="2.10.0+cu128")
    with pytest.raises(MeshlmError, match=r"^meshlm needs torch >= 2\.11\.0; found torch 2\.10\.0\+cu128"):
        versions.check()
    _installed(monkeypatch, torch="2.15.0", transformers="5.30.0")
    versions.check()


def _older(tmp_path: Path, package: str, release: str) -> dict:
    """An environment whose `package` reads as `release`: its metadata found first on the path."""
    meta = tmp_path / "older" / f"{package}-{release}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {release}\n")
    return {"PYTHONPATH": os.pathsep.join([str(SRC), str(tmp_path / "older"), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("package, release", [("transformers", "5.16.0"), ("torch", "2.10.0")])
def test_meshlm_refuses_an_older_release_at_start_up(tmp_path, package, release):
    out = tmp_path / "run"
    env = _older(tmp_path, package, release)
    p = run_meshlm("train", "--output-dir", out, env=env, check=False, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        f"meshlm: error: meshlm needs {package} >= {versions.OLDEST[package]}; found {package} {release}: "
        f"pip install '{package}>={versions.OLDEST[package]}'"
    ]
    assert not out.exists()
    report = run_meshlm("env", env=env, timeout=120).stdout
    assert f"{release} (older than the tested range" in report
