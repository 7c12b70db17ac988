"""The gpu-check driver's logic, on CPU: which rows run for how many GPUs and in which order, their estimates
against one lease, each row passing or failing on its own, and the driver end to end with stand-in rows (one
raising, one overrunning the deadline): every finished row's report written as it ends, the overrunning row cut
with its partial numbers, the rows after it not run."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from helpers.bench import script

gpu_check = script("gpu_check")
gpu_check_rows = script("gpu_check_rows")
Row = gpu_check_rows.Row


def test_rows_by_gpu_count_and_lease():
    rows = gpu_check_rows.rows()
    default = [r.name for r in gpu_check.choose(rows, 1, False, "")]
    first = [r.name for r in rows if r.lease == "first"]
    # the headline first, then flex, float8 and torchtitan, then the short correctness rows
    assert default[:4] == first and first[0] == gpu_check_rows.HEADLINE and "flex" in first[1]
    assert "float8" in first[2] and "torchtitan" in first[3]
    assert {"default job fp32", "default job bf16", "compile", "plan --validate ~1B"} <= set(default[4:])
    assert not any(r.lease == "later" for r in gpu_check.choose(rows, 1, False, ""))
    one = {r.name for r in gpu_check.choose(rows, 1, True, "")}
    assert {"tests marked gpu", "MFU table ~1B bf16 (target 45%)", "64k tokens ~1B: chunked loss, ac, offload"} <= one
    assert not any(n.startswith("parity") or "DataParallel" in n for n in one)
    two = {r.name for r in gpu_check.choose(rows, 2, True, "")}
    for layout in ("ddp", "zero1", "zero2", "zero3", "zero3 --cpu-offload", "tp", "pp"):
        assert f"parity {layout}" in two
    assert {"meshlm verify", "generate --mode pp over NCCL", "resume failure over NCCL"} <= two
    four = {r.name for r in gpu_check.choose(rows, 4, True, "")}
    assert {"parity hsdp 2x2", "parity fsdp+tp 2x2"} <= four - two


def test_first_lease_fits_its_command(capsys):
    """--dry-run lists the default rows with their estimates; the first-lease set stays within 480 s."""
    first = [r for r in gpu_check_rows.rows() if r.lease == "first"]
    total = sum(r.seconds for r in first) + gpu_check.INSTALL_S * len({r.wheels for r in first if r.wheels})
    assert total <= 480 and gpu_check.DEADLINE_S < 600
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(r.name in out for r in first) and f"first-lease set: {total:.0f} s" in out
    assert 'carry=[".whl"]' in out and "--deadline 540" in out


def test_layouts_keep_the_global_batch():
    for name, (ranks, args) in gpu_check_rows.LAYOUTS.items():
        value = dict(zip(args[::2], args[1::2]))
        tp, pp = int(value.get("--parallel.tp", 1)), int(value.get("--parallel.pp", 1))
        dp = ranks // (tp * pp)
        assert int(value["--micro-batch-size"]) * int(value.get("--grad-accum", 1)) * dp == 8, name


def test_each_check_passes_or_fails_on_its_own(tmp_path):
    def good(d):
        return "fine", {"x": 1}

    def bad(d):
        raise gpu_check.CheckFailed("meshlm train exited 1: boom")

    def buggy(d):
        raise KeyError("oops")

    results = [gpu_check.run_check(n, f, tmp_path) for n, f in (("a", good), ("b", bad), ("c", buggy), ("d", good))]
    assert [r["status"] for r in results] == ["pass", "FAIL", "FAIL", "pass"]
    assert results[1]["detail"] == "meshlm train exited 1: boom" and "KeyError" in results[2]["detail"]
    info = {"gpus": ["NVIDIA H100 80GB HBM3"], "torch": "2.11.0", "cuda": "12.8", "transformers": "5.0", "python": "3"}
    gpu_check.report(results, info, tmp_path)
    md = (tmp_path / "gpu-check.md").read_text()
    assert "2 pass, 2 FAIL of 4" in md and "| b | FAIL |" in md and "| a | pass | fine |" in md
    assert json.loads((tmp_path / "gpu-check.json").read_text())["results"][0]["x"] == 1


def _finishes(work):
    run = work / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 2.0, "tokens_per_s": 900.0}) + "\n")
    return "finished", {"tokens_per_s": 900.0}


def _raises(work):
    raise RuntimeError("a bug in this row")


def _overruns(work, out):
    """Logs one metrics row, starts a process of its own, and outlives the deadline."""
    (out / "seen.json").write_text((out / "gpu-check.json").read_text())  # the report as this row starts
    run = work / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 2.5, "tokens_per_s": 700.0, "x": 1}) + "\n")
    sleeper = subprocess.Popen(["sleep", "60"])
    (out / "sleeper.pid").write_text(str(sleeper.pid))
    sleeper.wait()
    return "should have been cut", {}


def _alive(pid: int, wait: float = 5.0) -> bool:
    """Whether `pid` still runs after `wait` seconds: gone, or a zombie its new parent has not reaped yet, is dead."""
    stat = Path(f"/proc/{pid}/stat")
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        except OSError:
            return False
        time.sleep(0.1)
    return True


def test_driver_end_to_end_with_stand_in_rows(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", tmp_path / "no-wheels")
    rows = [
        Row("finishes", _finishes, 1, "first"),
        Row("raises", _raises, 1, "first"),
        Row("overruns", lambda work: _overruns(work, out), 1, "first"),
        Row("after the deadline", _finishes, 1, "spare"),
        Row("needs torchao", _finishes, 1, "first", wheels="torchao"),
    ]
    info = {"gpus": [], "torch": "2", "cuda": None, "transformers": "5", "python": "3"}
    t0 = time.monotonic()
    results = gpu_check.run_rows(rows, out, t0 + 8, info)
    assert time.monotonic() - t0 < 30
    assert [r["status"] for r in results] == ["pass", "FAIL", "cut", "not run", "not run"]
    # the finished rows' report was on disk before the overrunning row started
    seen = json.loads((out / "seen.json").read_text())["results"]
    assert [(r["check"], r["status"]) for r in seen] == [("finishes", "pass"), ("raises", "FAIL")]
    assert "RuntimeError: a bug in this row" in results[1]["detail"]
    cut = results[2]
    assert cut["detail"].startswith("cut at the deadline") and cut["partial"] == {
        "run": {"step": 3, "loss": 2.5, "tokens_per_s": 700.0}
    }
    assert not _alive(int((out / "sleeper.pid").read_text()))  # the row's own process was killed too
    assert "no wheel for torchao==0.18.0" in results[4]["detail"] and "make gpu-wheels" in capsys.readouterr().out
    report = json.loads((out / "gpu-check.json").read_text())["results"]
    assert [r["status"] for r in report] == [r["status"] for r in results] and report[0]["tokens_per_s"] == 900.0
    md = (out / "gpu-check.md").read_text()
    assert "| overruns | cut |" in md and "| needs torchao | not run |" in md


def test_no_gpu_is_one_line_and_success(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 0)
    assert gpu_check.main(["--out", "unused"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu-check: no CUDA GPU visible")
