"""A hub id that cannot be read (no network, not in the hub cache): one line naming the fix, not the hub client's
retries."""

from __future__ import annotations

import pytest

from conftest import run_meshlm

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("offline", [False, True], ids=["hub-unreachable", "hf-hub-offline"])
def test_an_unreadable_hub_id_is_one_line(tmp_path, offline):
    # a closed local port stands for a hub out of reach: the client retries with back-off, as with no network
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": str(int(offline))}
    p = run_meshlm(
        "train", "--model-name", "meshlm-test/not-cached", "--output-dir", tmp_path / "out", env=env, check=False
    )
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert lines[0].startswith("meshlm: error: could not read a model config from 'meshlm-test/not-cached'")
    fix = "HF_HUB_OFFLINE is set; give a local directory" if offline else "set HF_HUB_OFFLINE=1"
    assert fix in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
