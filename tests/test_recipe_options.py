"""Smaller options users of the classic recipes expect: scale-lr, sync-batchnorm, bf16 autocast."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import SINGLE, losses, run_meshlm
from meshlm.config import Config
from meshlm.runtime import Runtime
from meshlm.train.schedule import lr_lambda, scaled_lr

pytestmark = pytest.mark.slow


def test_scale_lr_follows_the_global_batch():
    cfg = Config(lr=1e-3, base_batch_size=8)
    assert scaled_lr(cfg, 32) == pytest.approx(1e-3)
    cfg.scale_lr = "linear"
    assert scaled_lr(cfg, 32) == pytest.approx(4e-3)
    cfg.scale_lr = "sqrt"
    assert scaled_lr(cfg, 32) == pytest.approx(2e-3)


def test_schedule_warms_up_then_decays_to_min_ratio():
    cfg = Config(warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    f = lr_lambda(cfg)
    assert [f(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))


def _sync_bn_worker(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from meshlm.engines.ddp import DDPEngine, DDPOptions
    from meshlm.errors import MeshlmError
    from meshlm.layout import Degrees, Layout

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(device)
    try:
        layout = Layout("ddp", Degrees(dp_replicate=world))
        rt = Runtime(rank, rank, world, device=device)
        engine = DDPEngine(model, layout, rt, DDPOptions(sync_batchnorm=True))
        q.put([type(m).__name__ for m in engine.module.modules()])
    except MeshlmError as e:
        q.put(str(e))
    # rank 0 hosts the store: leaving before rank 1 has built its mesh breaks rank 1's pipe to it
    dist.barrier()
    dist.destroy_process_group()


def _sync_bn_on_two_ranks() -> list:
    """What each of 2 ranks (spawned, gloo) got from DDPEngine with --sync-batchnorm: module names, or the error."""
    import socket

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_sync_bn_worker, args=(2, port, q), nprocs=2, start_method="spawn")
    return [q.get(timeout=5) for _ in range(2)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU half; GPUs: the test below")
def test_sync_batchnorm_says_why_not_on_cpu():
    # SyncBatchNorm has no CPU kernel: a one-line error instead of DDP's deep assertion
    got = _sync_bn_on_two_ranks()
    assert all("--sync-batchnorm needs GPUs" in m for m in got), got


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one rank per GPU: needs 2 CUDA GPUs")
def test_sync_batchnorm_converts_under_ddp_on_gpus():
    got = _sync_bn_on_two_ranks()
    assert all("SyncBatchNorm" in n and "BatchNorm1d" not in n for n in got), got


def test_bf16_autocast_trains_close_to_fp32(single_run, tmp_path):
    """The session's fp32 single run again under bf16 autocast: different losses, within 2% of fp32."""
    run_meshlm("train", *SINGLE, "--mixed-precision", "bf16", "--output-dir", tmp_path / "bf16")
    a, b = losses(single_run), losses(tmp_path / "bf16")
    assert a != b  # autocast really ran in bf16
    assert all(abs(x - y) / x < 0.02 for x, y in zip(a, b)), (a, b)
