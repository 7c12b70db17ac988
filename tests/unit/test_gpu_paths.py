"""GPU/NCCL decisions that can be checked without a GPU: which backends the process group gets, when
nn.DataParallel wraps, the --strategy dp --compile refusal, and the multi-node rendezvous id."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import Config
from meshlm.engines import dp
from meshlm.errors import MeshlmError
from meshlm.launch import LaunchOptions, check, run_id
from meshlm.layout import Layout, resolve
from meshlm.runtime import Runtime, backend_spec


def test_offload_gets_gloo_beside_nccl():
    assert backend_spec("nccl", cuda=True, cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert backend_spec("nccl", cuda=True, cpu_collectives=False) == "nccl"  # no CPU state: NCCL alone
    assert backend_spec("gloo", cuda=False, cpu_collectives=True) == "gloo"  # gloo moves CPU tensors already


def test_dp_refuses_compile_in_one_line():
    with pytest.raises(MeshlmError, match="does not combine with --compile"):
        resolve(Config(strategy="dp", compile=True), 1)
    assert resolve(Config(strategy="dp"), 1).strategy == "dp"


def test_dp_never_wraps_a_cpu_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a 4-GPU box running --backend gloo
    assert not dp.wraps(torch.device("cpu"))
    assert dp.wraps(torch.device("cuda", 0))
    engine = dp.DataParallelEngine(torch.nn.Linear(2, 2), Layout("dp"), Runtime())
    assert not isinstance(engine.model, torch.nn.DataParallel)


def test_nodes_agree_on_the_rendezvous_id_without_rdzv_id():
    ids = {
        run_id(LaunchOptions(nproc=2, nnodes=2, node_rank=r, rdzv_endpoint=ep), 29400)
        for r, ep in ((0, "10.0.0.1:29400"), (1, "node0.cluster:29400"))
    }
    assert len(ids) == 1  # derived from what every node shares, not drawn at random
    assert run_id(LaunchOptions(nnodes=2, rdzv_id="job-7"), 29400) == "job-7"
    one = {run_id(LaunchOptions(nproc=2), 0) for _ in range(3)}
    assert len(one) == 3  # a single node keeps a fresh id per run
    with pytest.raises(MeshlmError, match="--rdzv-timeout"):
        check(LaunchOptions(nproc=1, nnodes=2, rdzv_endpoint="h:1", rdzv_timeout=0))
