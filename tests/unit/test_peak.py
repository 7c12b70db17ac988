"""MFU's peak: the exact GPU part from its name, the compute dtype, and the devices one process drives."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import Config
from meshlm.hardware import GPUS, known_peak
from meshlm.runtime import Runtime
from meshlm.train import metrics
from meshlm.train.metrics import job_peak_flops

# torch.cuda.get_device_name strings as drivers report them
NAMES = {
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 989.4e12),
    "NVIDIA H100 PCIe": ("H100 PCIe", 756e12),
    "NVIDIA H100 NVL": ("H100 NVL", 835e12),
    "NVIDIA H200": ("H200 SXM", 989.4e12),
    "NVIDIA H200 NVL": ("H200 NVL", 835e12),
    "NVIDIA A100-SXM4-80GB": ("A100", 312e12),
    "NVIDIA A100 80GB PCIe": ("A100", 312e12),
    "NVIDIA L4": ("L4", 121e12),
    "NVIDIA L40": ("L40", 181e12),
    "NVIDIA L40S": ("L40S", 362e12),
    "NVIDIA A10G": ("A10G", 125e12),
    "NVIDIA GeForce RTX 4090": ("RTX 4090", 165.2e12),
}


@pytest.mark.parametrize("name", NAMES)
def test_part_from_device_name(name):
    assert known_peak(name, "bf16") == NAMES[name]


def test_unknown_part_is_measured():
    assert known_peak("NVIDIA GeForce GTX 1080", "bf16") is None
    assert known_peak("NVIDIA L400", "bf16") is None  # no part is matched inside another name


def test_peak_follows_the_compute_dtype():
    h100 = "NVIDIA H100 80GB HBM3"
    fp32, tf32, bf16 = (known_peak(h100, d)[1] for d in ("fp32", "tf32", "bf16"))
    assert fp32 < tf32 < bf16 and round(bf16 / fp32) == 15  # the 15x the bf16-only peak was off by in fp32
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert metrics.compute_dtype("bf16", cuda) == "bf16"
    assert metrics.compute_dtype("no", cpu) == "fp32"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert metrics.compute_dtype("no", cuda) == "fp32"
        torch.set_float32_matmul_precision("high")  # TF32 allowed
        assert metrics.compute_dtype("no", cuda) == "tf32"
        assert metrics.compute_dtype("no", cpu) == "fp32"  # TF32 is a CUDA matmul mode
    finally:
        torch.set_float32_matmul_precision(before)


def test_devices_one_process_drives(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert metrics.devices_driven("dp", cuda, "") == 4  # nn.DataParallel: every visible GPU
    assert metrics.devices_driven("dp", cpu, "") == 1  # --backend gloo: a CPU model is never wrapped
    assert metrics.devices_driven("layer-split", cuda, "cuda:0,cuda:1,cuda:2") == 3
    assert metrics.devices_driven("layer-split", cuda, "cuda:0,cpu") == 1
    assert metrics.devices_driven("layer-split", cpu, "cpu,cpu") == 1
    assert metrics.devices_driven("ddp", cuda, "") == 1


def test_job_peak_multiplies_devices_and_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 PCIe")
    cfg = Config(mixed_precision="bf16")
    one = Runtime(device=torch.device("cuda", 0))
    assert job_peak_flops(cfg, one, "dp", tmp_path) == 2 * 756e12
    four = Runtime(rank=0, world_size=4, device=torch.device("cuda", 0))
    assert job_peak_flops(cfg, four, "ddp", tmp_path) == 4 * 756e12


def test_one_table_serves_mfu_and_the_planner():
    """The planner's GPUs are rows of the same table MFU reads: an H100's memory and bandwidth beside its peaks."""
    assert GPUS["h100"] == (80 * 2**30, 989e12, 67e12, 3.35e12)  # the planner's rounded figures, as it priced them
    assert known_peak("NVIDIA H100 80GB HBM3", "bf16") == ("H100 SXM", 989.4e12)
    assert set(GPUS) == {"h100", "h200", "a100-80gb", "a100-40gb", "l40s", "l4"}


def test_a_cpu_peak_is_measured_once_per_process(tmp_path, monkeypatch):
    """A process running several jobs in turn (the Python API, tests' family runs) measures its matmuls once."""
    metrics._measure_peak.cache_clear()
    first = metrics.peak_flops(torch.device("cpu"), tmp_path)

    def measured_again(*a, **k):
        raise AssertionError("measured the peak again")

    monkeypatch.setattr(torch, "randn", measured_again)
    assert metrics.peak_flops(torch.device("cpu"), tmp_path) == first > 0
