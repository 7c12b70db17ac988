"""The training recipe end to end: DDP parity with one process, bitwise resume, launcher behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from conftest import TINY, assert_close, losses, metrics, run_cases, run_meshlm

pytestmark = pytest.mark.slow

STEPS = ["--max-steps", "10"]


DDP = {(2, 4, 1): "two ranks", (2, 2, 2): "two ranks, 2 micro-batches each", (4, 2, 1): "four ranks"}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict[tuple, Path]:
    """The 2-rank runs in one launch (tests/helpers/family_runs.py: one process start-up for both); 4 ranks through
    `meshlm train --nproc 4`, its launcher and per-rank logs."""
    root = tmp_path_factory.mktemp("ddp")
    outs = {key: root / f"ddp-{'-'.join(map(str, key))}" for key in DDP}

    def args(micro, accum, out):
        return [*TINY, *STEPS, "--strategy", "ddp", "--micro-batch-size", micro, "--grad-accum", accum,
                "--output-dir", out]  # fmt: skip

    two = [
        {"id": str(key), "kind": "train", "args": [str(a) for a in args(*key[1:], out)]}
        for key, out in outs.items()
        if key[0] == 2
    ]
    run_cases(2, two, root / "launch-2")
    run_meshlm("train", *args(2, 1, outs[(4, 2, 1)]), "--nproc", 4)
    return outs


@pytest.mark.parametrize("key", list(DDP), ids=list(DDP.values()))
def test_ddp_matches_single_process(single_run, ddp_runs, key):
    """Same global batch (8) split over ranks and accumulation steps: same losses within 1e-5 relative (fp32)."""
    out = ddp_runs[key]
    assert_close(losses(out), losses(single_run), rtol=1e-5)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["mem_peak_bytes"] > 0 for r in rows)
    assert (out / "logs" / f"rank-{key[0] - 1}.log").is_file()


def test_loss_falls_on_the_builtin_default(single_run):
    first, last = losses(single_run)[0], losses(single_run)[-1]
    assert last < 0.8 * first, (first, last)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel wraps only over 2 or more GPUs")
def test_dp_wraps_the_gpus_and_matches_one_gpu(tmp_path):
    """nn.DataParallel over every visible GPU against the same job on one GPU (relative 1e-4: GPU kernels and the
    replicas' gradient sum round differently). On CPU dp runs as one device (tests/unit/test_gpu_paths.py)."""
    one = run_meshlm("train", *TINY, *STEPS, "--micro-batch-size", "8", "--output-dir", tmp_path / "one")
    p = run_meshlm(
        "train", *TINY, *STEPS, "--strategy", "dp", "--micro-batch-size", "8", "--output-dir", tmp_path / "dp"
    )
    assert "cuda" in one.stdout + one.stderr
    assert f"nn.DataParallel over {torch.cuda.device_count()} GPUs" in p.stdout + p.stderr
    assert_close(losses(tmp_path / "dp"), losses(tmp_path / "one"), rtol=1e-4)


def _final_state(out) -> dict:
    return _load_state_dict_from_keys(checkpoint_id=str(out / "checkpoints" / "step-20" / "state"))


@pytest.mark.parametrize("nproc", [0, 2])
def test_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path, nproc):
    """Crash inside step 11 (an injected fault, after the step-10 checkpoint), rerun: parameters and
    optimizer state at step 20 equal an uninterrupted 20-step run bit for bit."""
    launch = ["--nproc", nproc, "--micro-batch-size", "4"] if nproc else ["--micro-batch-size", "8"]
    args = ["train", *TINY, "--max-steps", "20", "--ckpt-every", "10", *launch]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run_meshlm(*args, "--output-dir", whole)
    crashed = run_meshlm(*args, "--output-dir", broken, env={"MESHLM_FAIL_AT_STEP": "11"}, check=False)
    assert crashed.returncode != 0 and "injected fault" in crashed.stderr
    assert (broken / "checkpoints" / "latest").read_text().strip() == "step-10"
    resumed = run_meshlm(*args, "--output-dir", broken)
    assert "resumed from" in resumed.stdout
    a, b = _final_state(whole), _final_state(broken)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    flat_a = {k: v for k, v in _flatten(a["optim"]).items() if isinstance(v, torch.Tensor)}
    flat_b = _flatten(b["optim"])
    assert flat_a and all(torch.equal(v, flat_b[k]) for k, v in flat_a.items())
    assert losses(broken)[-10:] == losses(whole)[-10:]


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_wandb_one_run_per_rank_and_tensorboard(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    run_meshlm(
        "train",
        *TINY,
        "--max-steps",
        "3",
        "--nproc",
        "2",
        "--micro-batch-size",
        "4",
        "--wandb",
        "--tensorboard",
        "--experiment-name",
        "exp1",
        "--output-dir",
        tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert any(r.endswith("exp1-rank0") for r in runs) and any(r.endswith("exp1-rank1") for r in runs), runs
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_peak_flops_keeps_the_fastest_measurement(tmp_path):
    """A peak measured while the cores were shared is too low (and MFU above 100%): the next start replaces it."""
    import json

    from meshlm.train.metrics import peak_flops

    cpu, key = torch.device("cpu"), f"cpu-{torch.get_num_threads()}threads-fp32"
    cached = tmp_path / "peak_flops.json"
    cached.write_text(json.dumps({key: 1.0, "other-device": 5.0}))
    measured = peak_flops(cpu, tmp_path)
    assert measured > 1e8  # any CPU core multiplies faster than 0.1 GFLOP/s
    assert json.loads(cached.read_text()) == {key: measured, "other-device": 5.0}
    cached.write_text(json.dumps({key: 1e15}))  # more than this CPU can do: the highest figure is kept
    assert peak_flops(cpu, tmp_path) == 1e15
