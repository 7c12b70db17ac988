"""`meshlm plan --device cpu`: the ranks are CPU processes of this machine, planned and named as such."""

from __future__ import annotations

import json
import os

import pytest

from meshlm.cli import main


def _plan(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--device", "cpu", "--gpus-per-node", "2", *args])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_cpu_ranks_are_priced_with_this_machine(capsys):
    table = _plan(capsys)
    assert "H100" not in table and "GPU" not in table, table
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert f"2 CPU rank(s) on this machine ({ram / 2 / 2**30:.1f} GiB of its RAM" in table, table
    assert "+offload" not in table  # CPU ranks are the host: nothing to offload to
    rows = json.loads(_plan(capsys, "--json"))["layouts"]
    # an H100 pair plans this model at ~50M tokens/s; no CPU computes a tenth of that
    assert rows and max(r["tokens_per_s"] for r in rows) < 5e6, [r["tokens_per_s"] for r in rows]
