"""`meshlm verify` on 4 CPU ranks, the comparison it rests on, `meshlm report`, and the plotting helpers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import run_meshlm, tree_digest
from uneven_data import uneven_records

from meshlm import cli
from meshlm import config as config_mod
from meshlm import report, verify

STEPS = 3
# Replication, sharding composed with tensor parallel, and a pipeline: every family of verify's comparison
# (replicated state, sharded state gathered, stages gathered). Each layout's own parity with single is tested
# in test_train, test_sharded and test_model_parallel; this checks verify itself, so three keep it short.
WANT = ("ddp", "fsdp+tp", "pp-1f1b")


def _tiny_cfg():
    p = verify.PRESETS["tiny"]
    return config_mod.load(None, [(k.lstrip("-").replace("-", "_"), v) for k, v in zip(p[::2], p[1::2])])


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    cfg = _tiny_cfg()
    names = [lay.name for lay in verify.layouts(4, 0) if lay.name in WANT and not verify.unavailable(lay, cfg, 8)]
    out = tmp_path_factory.mktemp("verify") / "run"
    p = run_meshlm("verify", "tiny", "--nproc", 4, "--steps", STEPS, "--layouts", ",".join(names), "--plot",
                   "--output-dir", out, "--warmup-steps", 1, "--dataset-name", uneven_records(out.parent),
                   check=False)
    return names, out, p


def test_every_available_layout_matches_single_on_4_ranks(verified):
    names, out, p = verified
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ddp" in names
    result = json.loads((out / "verify.json").read_text())
    rows = {r["layout"]: r for r in result["rows"]}
    assert list(rows) == ["single", *names]
    tol = result["tolerance"]
    assert tol == {"loss": 1e-4, "grad_norm": 1e-3, "params": 1e-3}
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
    ok = verify.compare(verify.Row("ddp", 4), ref_rows, rows, ref_params, params, verify.Layout("ddp", 4, "ddp"), tol)
    assert ok.status == "ok", ok.problems

    name = next(iter(params))
    nudged = {**params, name: params[name] + 1e-2 * params[name].abs().max()}
    bad = verify.compare(verify.Row("ddp", 4), ref_rows, rows, ref_params, nudged, verify.Layout("ddp", 4, "ddp"), tol)
    assert bad.status == "FAIL" and bad.params == pytest.approx(1e-2, rel=1e-3)
    assert any(p.startswith("params difference") for p in bad.problems)

    off = [dict(r, loss=r["loss"] * (1 + 1e-3)) for r in rows]
    bad = verify.compare(verify.Row("ddp", 4), ref_rows, off, ref_params, params, verify.Layout("ddp", 4, "ddp"), tol)
    assert bad.status == "FAIL" and any(p.startswith("loss difference") for p in bad.problems)

    missing = {k: v for k, v in params.items() if k != name}
    bad = verify.compare(verify.Row("ddp", 4), ref_rows, rows, ref_params, missing, verify.Layout("ddp", 4, "ddp"),
                         tol)
    assert bad.status == "FAIL" and any("parameter names differ" in p for p in bad.problems)

    # A layout that claims to shard but holds the whole model on rank 0 is not what it says it is.
    fake = verify.compare(verify.Row("zero3", 4), ref_rows, rows, ref_params, params,
                          verify.Layout("zero3", 4, "zero3"), tol)
    assert fake.status == "FAIL" and any("nothing was sharded" in p for p in fake.problems)


def test_report_plots_a_runs_metrics(verified, tmp_path):
    _, out, _ = verified
    p = run_meshlm("report", out / "ddp")
    written = [line for line in p.stdout.splitlines() if line.endswith(".png")]
    assert sorted(n.rsplit("/", 1)[-1] for n in written) == ["loss.png", "memory.png", "tokens_per_s.png"]
    for w in written:
        assert open(w, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    bad = run_meshlm("report", tmp_path / "nowhere", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("meshlm: error:") and "metrics.jsonl" in bad.stderr


def test_layouts_the_rank_count_allows():
    names = lambda w: [lay.name for lay in verify.layouts(w, 0)]  # noqa: E731
    assert names(1) == ["dp", "layer-split"]
    assert "hsdp" not in names(2) and "fsdp+tp" not in names(2) and {"ddp", "tp", "pp-1f1b"} <= set(names(2))
    assert {"hsdp", "fsdp+tp", "ddp+pp", "fsdp+pp", "tp+pp"} <= set(names(4)) and "fsdp+tp+pp" not in names(4)
    assert "fsdp+tp+pp" in names(8)
    for w in (2, 4, 8):
        for lay in verify.layouts(w, 0):
            assert lay.nproc == 0 or lay.tp * lay.pp * lay.dp == w, lay


def test_unavailable_is_decided_before_running():
    cfg = _tiny_cfg()
    ddp = verify.Layout("ddp", 4, "ddp")
    assert verify.unavailable(ddp, cfg, 8) == ""
    assert "does not split over 4 data-parallel ranks" in verify.unavailable(ddp, cfg, 6)
    assert "runs in one process" in verify.unavailable(verify.Layout("x", 4, "single"), cfg, 8)


@pytest.mark.parametrize("args,message", [
    (["--strategy", "ddp"], "sets --strategy itself"),
    (["--layouts", "ddp,zero9"], "zero9 is not a layout for 4 ranks"),
    (["--global-batch", "6", "--layouts", "ddp"], "no layout asked for can run here"),
    (["--model-name", "/no/such/model"], "model directory /no/such/model does not exist"),
])
def test_bad_input_one_line_and_nothing_runs(tmp_path, capsys, args, message):
    """In this process (the CLI's own main): one `meshlm: error:` line, exit 2, no output directory."""
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", *args, "--output-dir", str(tmp_path / "fresh")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("meshlm: error:") and message in err, err
    assert not (tmp_path / "fresh").exists()


def test_existing_output_dir_is_left_alone(tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = tree_digest(out)
    p = run_meshlm("verify", "--layouts", "ddp", "--output-dir", out, check=False)
    assert p.returncode == 2 and p.stderr.startswith("meshlm: error:") and "is not empty" in p.stderr, p.stderr
    assert tree_digest(out) == before


# ---------------------------------------------------------------- plotting helpers on synthetic inputs

def _gpipe(stages: int, micro: int, f: float = 1.0, b: float = 2.0) -> list[dict]:
    """An ideal GPipe schedule: stage s runs forward m at (s + m) f, backwards after all forwards."""
    events = []
    for s in range(stages):
        for m in range(micro):
            start = (s + m) * f
            events.append({"rank": s, "stage": s, "micro_batch": m, "action": "F", "start": start, "end": start + f})
    t_fwd = (stages + micro - 1) * f
    for s in range(stages):
        for m in range(micro):
            start = t_fwd + (stages - 1 - s + m) * b
            events.append({"rank": s, "stage": s, "micro_batch": m, "action": "B", "start": start, "end": start + b})
    return events


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 4)])
def test_pipeline_timeline_measures_the_textbook_bubble(tmp_path, stages, micro):
    events = _gpipe(stages, micro)
    assert report.bubble_fraction(events) == pytest.approx((stages - 1) / (micro + stages - 1))
    png = report.plot_pipeline_timeline(events, tmp_path / "timeline.png", title=f"gpipe {stages}x{micro}")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_memory_bars_predicted_and_measured(tmp_path):
    gib = 2**30
    predicted = {"ddp": {"parameters": 2 * gib, "gradients": 2 * gib, "optimizer": 8 * gib, "activations": 20 * gib},
                 "zero3": {"parameters": 0.5 * gib, "gradients": 0.5 * gib, "optimizer": 2 * gib,
                           "activations": 20 * gib, "buffers": 1 * gib}}
    png = report.plot_memory_bars(predicted, tmp_path / "plan.png", gpu_bytes=80 * gib,
                                  measured={"ddp": 31 * gib, "zero3": 25 * gib})
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    with pytest.raises(ValueError):
        report.plot_memory_bars({}, tmp_path / "empty.png")


def test_param_diff_is_relative_to_each_tensor():
    ref = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-3, 0.0])}
    assert verify.param_diff(ref, {k: v.clone() for k, v in ref.items()}) == (0.0, "")
    diff, problem = verify.param_diff(ref, {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-3, 1e-6])})
    assert diff == pytest.approx(1e-3) and problem == ""
    diff, problem = verify.param_diff(ref, {"a": torch.zeros(3), "b": ref["b"]})
    assert math.isinf(diff) and "shape" in problem
