"""Simulation against reality: `meshlm plan --validate --simulate` trains zero1 (bf16 master weights with DDP's
bucketed all-reduce, which the simulation runs through its stand-ins) and zero3 (FSDP2) on 2 gloo ranks with the
built-in model at the validation's defaults (seq 64, micro-batch 1, bf16), its probe measuring the last step on
every rank, and simulates every rank of the same layouts (meshlm's build, parallelize and steps on fake tensors
over a fake process group) under that same probe. The simulated model states equal the measured ones to the
byte, and the activation peaks agree within the validation's own target (20%)."""

from __future__ import annotations

import json

import pytest

from conftest import run_meshlm

pytestmark = pytest.mark.slow


def test_simulated_ranks_match_the_measured_ones():
    p = run_meshlm(
        *(
            "plan",
            "--validate",
            "--simulate",
            "--nproc",
            "2",
            "--strategy",
            "zero1,zero3",
            "--tp",
            "1",
            "--pp",
            "1",
            "--cp",
            "1",
        ),
        "--json",
    )
    results = {r["layout"]: r for r in json.loads(p.stdout)["results"]}
    assert set(results) == {"zero1", "zero3"}
    for name, r in results.items():
        assert r["ok"], (name, r)
        rows = {row["quantity"]: row for row in r["simulated"]}
        assert set(rows) == {"model states", "activation peak"}
        assert rows["model states"]["simulated"] == rows["model states"]["measured"], (name, rows)
        assert rows["activation peak"]["ratio"] == pytest.approx(1, abs=0.20), (name, rows)
        measured = {m["rank"]: m["model_state_bytes"] for m in r["probes"]}
        assert sorted(measured) == [0, 1]
    # zero1 keeps whole bf16 parameters and gradients (2 + 2 + 12/N bytes each), zero3 shards everything (16/N)
    assert results["zero1"]["simulated"][0]["simulated"] > results["zero3"]["simulated"][0]["simulated"]
