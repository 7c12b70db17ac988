"""`meshlm verify` on 4 CPU ranks, the comparison it rests on, and `meshlm report` (the in-process checks and
the plotting helpers are tests/unit/test_verify_cases.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import TINY, run_meshlm, tree_digest
from meshlm import verify
from uneven_data import uneven_records

pytestmark = pytest.mark.slow

STEPS = 3
# Replication, sharding composed with tensor parallel, and a pipeline: every family of verify's comparison
# (replicated state, sharded state gathered, stages gathered). Each layout's own parity with single is tested
# in test_train, test_sharded and test_model_parallel; this checks verify itself, so three keep it short.
WANT = ("ddp", "fsdp+tp", "pp-1f1b")


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    names = list(WANT)  # asked by name: one that cannot run here fails verify, never drops out of the list
    out = tmp_path_factory.mktemp("verify") / "run"
    p = run_meshlm(
        "verify",
        "tiny",
        "--nproc",
        4,
        "--steps",
        STEPS,
        "--layouts",
        ",".join(names),
        "--plot",
        "--keep",
        "--output-dir",
        out,
        "--warmup-steps",
        1,
        "--dataset-name",
        uneven_records(out.parent),
        check=False,
    )
    return names, out, p


def test_every_available_layout_matches_single_on_4_ranks(verified):
    names, out, p = verified
    assert p.returncode == 0, p.stdout + p.stderr
    assert names == ["ddp", "fsdp+tp", "pp-1f1b"]
    result = json.loads((out / "verify.json").read_text())
    rows = {r["layout"]: r for r in result["rows"]}
    assert list(rows) == ["single", *names]
    tol = result["tolerance"]
    assert tol == {"loss": 1e-4, "grad_norm": 1e-3, "params": 1e-3, "rewards": 1e-4}
    assert f"tolerance: loss {tol['loss']:g}" in p.stdout
    assert "dropout off" in p.stdout.splitlines()[0]
    for name in names:
        r = rows[name]
        assert r["status"] == "ok" and not r["problems"], r
        assert len(r["losses"]) == STEPS
        assert r["loss"] <= tol["loss"] and r["grad_norm"] <= tol["grad_norm"] and r["params"] <= tol["params"]
        assert any(line.split()[:2] == [name, "4"] and line.rstrip().endswith("ok") for line in p.stdout.splitlines())
    assert rows["ddp"]["state"] == pytest.approx(1.0)  # DDP replicates: the same state per rank as one device
    for name in names:
        if name != "ddp":  # every other layout shards something, and rank 0 holds visibly less
            assert rows[name]["state"] < 0.9, rows[name]
    assert f"verify: {len(names)} of {len(names)} layouts that ran match single" in p.stdout
    png = out / "verify-loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_compare_fails_on_real_checkpoints_that_differ(verified):
    """The comparison can fail: the reference and ddp runs' own outputs, perturbed slightly, are caught."""
    _, out, _ = verified
    ref_rows, rows = verify._read_metrics(out / "single"), verify._read_metrics(out / "ddp")
    ref_params, params = verify._read_params(out / "single", STEPS), verify._read_params(out / "ddp", STEPS)
    tol = verify.TOLERANCE
    ok = verify.compare(verify.Row("ddp", 4), ref_rows, rows, ref_params, params, verify.Case("ddp", 4, "ddp"), tol)
    assert ok.status == "ok", ok.problems

    name = next(iter(params))
    nudged = {**params, name: params[name] * (1 + 1e-2)}
    bad = verify.compare(verify.Row("ddp", 4), ref_rows, rows, ref_params, nudged, verify.Case("ddp", 4, "ddp"), tol)
    assert bad.status == "FAIL" and bad.params == pytest.approx(1e-2, rel=1e-3)
    assert any(p.startswith("params difference") for p in bad.problems)

    off = [dict(r, loss=r["loss"] * (1 + 1e-3)) for r in rows]
    bad = verify.compare(verify.Row("ddp", 4), ref_rows, off, ref_params, params, verify.Case("ddp", 4, "ddp"), tol)
    assert bad.status == "FAIL" and any(p.startswith("loss difference") for p in bad.problems)

    missing = {k: v for k, v in params.items() if k != name}
    bad = verify.compare(verify.Row("ddp", 4), ref_rows, rows, ref_params, missing, verify.Case("ddp", 4, "ddp"), tol)
    assert bad.status == "FAIL" and any("parameter names differ" in p for p in bad.problems)

    # A layout that claims to shard but holds the whole model on rank 0 is not what it says it is.
    fake = verify.compare(
        verify.Row("zero3", 4), ref_rows, rows, ref_params, params, verify.Case("zero3", 4, "zero3"), tol
    )
    assert fake.status == "FAIL" and any("nothing was sharded" in p for p in fake.problems)


def _report(capsys, run: Path) -> tuple[int, str, str]:
    """`meshlm report RUN` in this process (it starts no ranks): exit status, stdout, stderr."""
    from meshlm.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["report", str(run)])
    said = capsys.readouterr()
    return e.value.code, said.out, said.err


def test_report_plots_a_runs_metrics(verified, tmp_path, capsys):
    _, out, _ = verified
    code, stdout, _ = _report(capsys, out / "ddp")
    assert code == 0
    written = [line for line in stdout.splitlines() if line.endswith(".png")]
    assert sorted(n.rsplit("/", 1)[-1] for n in written) == ["loss.png", "memory.png", "tokens_per_s.png"]
    for w in written:
        assert open(w, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    code, _, stderr = _report(capsys, tmp_path / "nowhere")
    assert code == 2 and stderr.strip().startswith("meshlm: error:") and "metrics.jsonl" in stderr


def test_existing_output_dir_is_left_alone(tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = tree_digest(out)
    p = run_meshlm("verify", "--layouts", "ddp", "--output-dir", out, check=False)
    assert p.returncode == 2 and p.stderr.startswith("meshlm: error:") and "is not empty" in p.stderr, p.stderr
    assert tree_digest(out) == before


# TINY's model (conftest) without the keys verify sets itself
SMALL = [*TINY[: TINY.index("--progress")], "--warmup-steps", "1"]


def test_a_gradient_left_unreduced_fails_the_parameters(tmp_path):
    """ddp with the final norm's gradient never all-reduced (tests/unreduced_gradient: each rank steps that weight
    with its own half of the batch), at a fine-tuning rate: the weight (1 at the start) moves by about the rate per
    step, so its difference is a few ten-thousandths of its size but of the order of its update, which is what
    the parameters are compared with. The failed runs stay on disk; 2 ranks say why hsdp does not run."""
    out = tmp_path / "v"
    broken = str(Path(__file__).parent / "unreduced_gradient")
    p = run_meshlm(
        *("verify", "--nproc", 2, "--layouts", "ddp,hsdp", "--steps", STEPS, *SMALL, "--lr", "1e-4"),
        *("--output-dir", out),
        env={"PYTHONPATH": os.pathsep.join([broken, os.environ.get("PYTHONPATH", "")])},
        check=False,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    rows = {r["layout"]: r for r in json.loads((out / "verify.json").read_text())["rows"]}
    assert rows["ddp"]["status"] == "FAIL" and rows["ddp"]["params"] > 0.1, rows["ddp"]
    assert any(problem.startswith("params difference") for problem in rows["ddp"]["problems"])
    assert rows["hsdp"]["status"].startswith("not available: hsdp needs 4 ranks or more")
    assert sorted(d.name for d in out.iterdir() if d.is_dir()) == ["ddp", "single"]
    assert f"runs kept in {out} (" in p.stdout
