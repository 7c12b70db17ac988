"""The training recipe end to end: DDP parity with one process, bitwise resume, launcher behaviour."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from conftest import TINY, assert_close, losses, metrics, run_meshlm

pytestmark = pytest.mark.slow

STEPS = ["--max-steps", "10"]


@pytest.mark.parametrize("nproc,micro,accum", [(2, 4, 1), (4, 2, 1), (2, 2, 2)])
def test_ddp_matches_single_process(single_run, tmp_path, nproc, micro, accum):
    """Same global batch (8) split over ranks and accumulation steps: same losses within 1e-5 relative (fp32)."""
    run_meshlm(
        "train",
        *TINY,
        *STEPS,
        "--nproc",
        nproc,
        "--strategy",
        "ddp",
        "--micro-batch-size",
        micro,
        "--grad-accum",
        accum,
        "--output-dir",
        tmp_path,
    )
    assert_close(losses(tmp_path), losses(single_run), rtol=1e-5)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["mem_peak_bytes"] > 0 for r in rows)
    assert (tmp_path / "logs" / f"rank-{nproc - 1}.log").is_file()


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
