"""The gpu-check driver's logic, on CPU: which checks run for how many GPUs, each passing or failing on
its own, and the report it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_check
import gpu_checks


def test_checks_by_gpu_count():
    one = [name for name, need, _ in gpu_checks.checks(1) if need <= 1]
    assert {
        "default job fp32",
        "default job bf16",
        "compile",
        "zero3 cpu-offload 1 GPU",
        "tests marked gpu",
        "plan --validate ~1B",
        "MFU benchmark ~1B bf16",
        "MFU >= 45% (target)",
    } <= set(one)
    assert not any(n.startswith("parity") for n in one)
    two = {name for name, need, _ in gpu_checks.checks(2) if need <= 2}
    for layout in ("ddp", "zero1", "zero2", "zero3", "zero3 --cpu-offload", "tp", "pp"):
        assert f"parity {layout}" in two
    assert {"meshlm verify", "generate --mode pp over NCCL", "resume failure over NCCL"} <= two
    # nn.DataParallel wraps only over 2 or more GPUs: on one it would compare single with single
    assert "dp (nn.DataParallel) 2+ GPUs" in two and not any("DataParallel" in n for n in one)
    four = {name for name, need, _ in gpu_checks.checks(4) if need <= 4}
    assert {"parity hsdp 2x2", "parity fsdp+tp 2x2"} <= four - two


def test_layouts_keep_the_global_batch():
    for name, (ranks, args) in gpu_checks.LAYOUTS.items():
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
    assert [r["ok"] for r in results] == [True, False, False, True]
    assert results[1]["detail"] == "meshlm train exited 1: boom" and "KeyError" in results[2]["detail"]
    info = {
        "gpus": ["NVIDIA H100 80GB HBM3"],
        "torch": "2.11.0",
        "cuda": "12.8",
        "transformers": "5.0",
        "python": "3.11",
        "host": "h",
    }
    gpu_check.report(results, info, tmp_path)
    md = (tmp_path / "gpu-check.md").read_text()
    assert "2 of 4 checks passed" in md and "| b | **FAIL** |" in md and "| a | pass | fine |" in md
    assert json.loads((tmp_path / "gpu-check.json").read_text())["results"][0]["x"] == 1


def test_no_gpu_is_one_line_and_success(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", "unused"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu-check: no CUDA GPU visible")
