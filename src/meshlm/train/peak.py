"""Peak FLOP/s for MFU: the dtype the matmuls run in and the devices a process drives; the figure per GPU part
is meshlm/hardware.py's (a part the table does not know is measured and cached under its name, train/metrics.py).
"""

from __future__ import annotations

import torch


def compute_dtype(mixed_precision: str, device: torch.device) -> str:
    """The dtype the matmuls run in: bf16 under --mixed-precision bf16; else fp32, or TF32 when CUDA
    matmuls are allowed to use it (torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision)."""
    if mixed_precision == "bf16":
        return "bf16"
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def devices_driven(strategy: str, device: torch.device, devices: str) -> int:
    """How many accelerators this one process computes on: nn.DataParallel drives every visible GPU,
    layer-split the GPUs of --devices (its CPU entries add no GPU peak); one otherwise."""
    if device.type != "cuda" and strategy != "layer-split":
        return 1
    if strategy == "dp":
        return max(1, torch.cuda.device_count())
    if strategy == "layer-split":
        return max(1, len({d.strip() for d in devices.split(",") if d.strip().startswith("cuda")}))
    return 1
