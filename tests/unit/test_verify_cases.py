"""`meshlm verify` in this process: which layouts a rank count allows, what is unavailable before anything runs,
bad input, the parameter comparison, and the plotting helpers on synthetic inputs. The real runs are
tests/test_verify.py."""

from __future__ import annotations

import math

import pytest
import torch

from meshlm import cli, report, verify
from meshlm import config as config_mod


def _tiny_cfg():
    return config_mod.load(None, config_mod.parse_args(verify.PRESETS["tiny"]))


def test_layouts_the_rank_count_allows():
    names = lambda w: [lay.name for lay in verify.layouts(w, 0)]  # noqa: E731
    assert names(1) == ["dp", "layer-split"]
    assert "fsdp+tp" not in names(2) and {"ddp", "tp", "pp-1f1b", "hsdp"} <= set(names(2))
    assert {"hsdp", "fsdp+tp", "ddp+pp", "fsdp+pp", "tp+pp"} <= set(names(4)) and "fsdp+tp+pp" not in names(4)
    assert "fsdp+tp+pp" in names(8)
    for w in (2, 4, 8):
        for lay in verify.layouts(w, 0):
            assert lay.nproc == 0 or lay.tp * lay.pp * lay.cp * lay.dp == w, lay


def test_unavailable_is_decided_before_running():
    cfg = _tiny_cfg()
    ddp = verify.Case("ddp", 4, "ddp")
    assert verify.unavailable(ddp, cfg, 8) == ""
    assert "does not split over 4 data-parallel ranks" in verify.unavailable(ddp, cfg, 6)
    assert "runs in one process" in verify.unavailable(verify.Case("x", 4, "single"), cfg, 8)
    # on 2 ranks hsdp would be ddp or zero3: a row says so rather than leaving it out
    hsdp = next(lay for lay in verify.layouts(2, 0) if lay.name == "hsdp")
    assert verify.unavailable(hsdp, cfg, 8).startswith("not available: hsdp needs 4 ranks or more")
    assert verify.unavailable(next(lay for lay in verify.layouts(4, 0) if lay.name == "hsdp"), cfg, 8) == ""


@pytest.mark.parametrize(
    "args,message",
    [
        (["--strategy", "ddp"], "sets --strategy itself"),
        (["--layouts", "ddp,zero9"], "zero9 is not a layout for 4 ranks"),
        (["--global-batch", "6", "--layouts", "ddp"], "no layout asked for can run here"),
        (["--model-name", "/no/such/model"], "model directory /no/such/model does not exist"),
    ],
)
def test_bad_input_one_line_and_nothing_runs(tmp_path, capsys, args, message):
    """In this process (the CLI's own main): one `meshlm: error:` line, exit 2, no output directory."""
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", *args, "--output-dir", str(tmp_path / "fresh")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("meshlm: error:") and message in err, err
    assert not (tmp_path / "fresh").exists()


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


def test_memory_bars_predicted_and_measured(tmp_path, monkeypatch):
    """What the figure holds when it is saved: per layout a stack of the predicted parts adding up to the
    prediction, a measured bar beside it at the measured value, the GPU's memory as a line, in GiB."""
    gib = 2**30
    predicted = {
        "ddp": {"parameters": 2 * gib, "gradients": 2 * gib, "optimizer": 8 * gib, "activations": 20 * gib},
        "zero3": {
            "parameters": 0.5 * gib,
            "gradients": 0.5 * gib,
            "optimizer": 2 * gib,
            "activations": 20 * gib,
            "buffers": 1 * gib,
        },
    }
    measured = {"ddp": 31 * gib, "zero3": 25 * gib}
    drawn, save = {}, report._save

    def keep(fig, path, metadata=None):  # the artists, before _save clears the figure
        ax = fig.axes[0]
        drawn["bars"] = [(r.get_x() + r.get_width() / 2, r.get_y(), r.get_height()) for r in ax.patches]
        drawn["lines"] = [line.get_ydata()[0] for line in ax.lines if len(line.get_ydata())]
        drawn["ylabel"], drawn["ticks"] = ax.get_ylabel(), [t.get_text() for t in ax.get_xticklabels()]
        return save(fig, path, metadata)

    monkeypatch.setattr(report, "_save", keep)
    png = report.plot_memory_bars(predicted, tmp_path / "plan.png", gpu_bytes=80 * gib, measured=measured)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert drawn["ylabel"] == "GiB per GPU" and drawn["ticks"] == ["ddp", "zero3"]
    assert drawn["lines"] == [80]
    for x, layout in enumerate(predicted):
        left = sorted((y, h) for c, y, h in drawn["bars"] if c < x and abs(c - x) < 0.5 and h > 0)
        right = [(y, h) for c, y, h in drawn["bars"] if c > x and abs(c - x) < 0.5]
        assert len(left) == len(predicted[layout]) and left[0][0] == 0  # one box per part, stacked from 0
        assert all(abs(a[0] + a[1] - b[0]) < 1e-9 for a, b in zip(left, left[1:]))  # each on the one below
        assert sum(h for _, h in left) == pytest.approx(sum(predicted[layout].values()) / gib)
        assert right == [(0, pytest.approx(measured[layout] / gib))]
    with pytest.raises(ValueError):
        report.plot_memory_bars({}, tmp_path / "empty.png")


def test_param_diff_is_relative_to_each_tensor():
    ref = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-3, 0.0])}
    assert verify.param_diff(ref, {k: v.clone() for k, v in ref.items()}) == (0.0, "")
    diff, problem = verify.param_diff(ref, {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([1e-3, 1e-6])})
    assert diff == pytest.approx(1e-3) and problem == ""
    diff, problem = verify.param_diff(ref, {"a": torch.zeros(3), "b": ref["b"]})
    assert math.isinf(diff) and "shape" in problem


def test_param_diff_is_relative_to_each_tensors_update():
    """Against how far training moved each tensor from its initial value, in norm. A norm weight (1 at the start)
    whose gradient one layout left unreduced, at a fine-tuning rate: half its elements stepped the wrong way by
    1e-4, a difference of 2e-4 of the weight (below the tolerance of 1e-3) but larger than its update. A bias
    that starts at zero, its key third moved by AdamW on a gradient that is zero in exact arithmetic: a rounding
    difference there is 1.2e-3 of the bias's largest value, a small part of its update in norm."""
    start = {"norm": torch.ones(64), "bias": torch.zeros(64)}
    update = torch.tensor([1e-4, -1e-4]).repeat(32)
    ref = {"norm": 1 + update, "bias": torch.full((64,), 1e-3)}
    wrong_way = torch.where(torch.arange(64) < 32, -update, update)
    diff, problem = verify.param_diff(ref, {**ref, "norm": 1 + wrong_way}, lambda name, like: start[name])
    assert diff == pytest.approx(2**0.5, rel=1e-3) and problem == ""
    rounded = ref["bias"].clone()
    rounded[40] += 1.2e-6
    diff, _ = verify.param_diff(ref, {**ref, "bias": rounded}, lambda name, like: start[name])
    assert diff == pytest.approx(1.2e-6 / 8e-3, rel=1e-3)


def test_only_the_runs_that_failed_are_kept(tmp_path, capsys):
    rows = [verify.Row("single", 1, "reference"), verify.Row("ddp", 2, "ok"), verify.Row("tp", 2, "FAIL")]
    rows.append(verify.Row("hsdp", 2, "not available: hsdp needs 4 ranks or more"))
    for r in rows[:3]:
        (tmp_path / r.layout / "checkpoints").mkdir(parents=True)
        (tmp_path / r.layout / "checkpoints" / "shard").write_bytes(b"x" * 2**20)
    o = verify.Options([], _tiny_cfg(), 2, None, 3, 8, tmp_path, False, verify.TOLERANCE, keep=True)
    assert verify.tidy(o, rows) == f"runs kept in {tmp_path} (3.0 MiB): single, ddp, tp"
    o.keep = False
    assert verify.tidy(o, rows) == f"runs kept in {tmp_path} (2.0 MiB): single, tp"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["single", "tp"]
    rows[2].status = "ok"
    assert verify.tidy(o, rows) == f"runs removed; {tmp_path} holds verify.json (--keep keeps every run's directory)"
    assert list(tmp_path.iterdir()) == []
