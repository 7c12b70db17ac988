"""Peak FLOP/s for MFU: by the exact GPU part and the dtype the matmuls run in.

Dense figures (no 2:4 sparsity) from NVIDIA's datasheets, FLOP/s per GPU: (fp32, tf32, bf16). A
part the table does not know is measured (a matmul in the compute dtype) and cached under its name.
Part names are matched most specific first: "H100 PCIe" and "H100 NVL" before "H100", "L40S" and
"L40" before "L4" (as whole words: "NVIDIA L40" is not an L4).
"""

from __future__ import annotations

import re

import torch

T = 1e12
# (pattern on torch.cuda.get_device_name, part, (fp32, tf32, bf16))
PARTS = [
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", (51.2 * T, 378 * T, 756 * T)),
    (r"\bH100\b.*\bNVL\b", "H100 NVL", (60 * T, 417.5 * T, 835 * T)),
    (r"\bH100\b", "H100 SXM", (66.9 * T, 494.7 * T, 989.4 * T)),
    (r"\bH200\b.*\bNVL\b", "H200 NVL", (60 * T, 417.5 * T, 835 * T)),
    (r"\bH200\b", "H200 SXM", (66.9 * T, 494.7 * T, 989.4 * T)),
    (r"\bB200\b", "B200", (80 * T, 1100 * T, 2250 * T)),
    (r"\bA100\b", "A100", (19.5 * T, 156 * T, 312 * T)),
    (r"\bL40S\b", "L40S", (91.6 * T, 183 * T, 362 * T)),
    (r"\bL40\b", "L40", (90.5 * T, 90.5 * T, 181 * T)),
    (r"\bL4\b", "L4", (30.3 * T, 60 * T, 121 * T)),
    (r"\bA10G\b", "A10G", (31.2 * T, 62.5 * T, 125 * T)),
    (r"\bA10\b", "A10", (31.2 * T, 62.5 * T, 125 * T)),
    (r"\bRTX 4090\b", "RTX 4090", (82.6 * T, 82.6 * T, 165.2 * T)),
]
DTYPES = ("fp32", "tf32", "bf16")


def compute_dtype(mixed_precision: str, device: torch.device) -> str:
    """The dtype the matmuls run in: bf16 under --mixed-precision bf16; else fp32, or TF32 when CUDA
    matmuls are allowed to use it (torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision)."""
    if mixed_precision == "bf16":
        return "bf16"
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def known_peak(device_name: str, dtype: str) -> tuple[str, float] | None:
    """(part, peak FLOP/s) of a GPU name in `dtype`, or None for a part not in the table."""
    for pattern, part, peaks in PARTS:
        if re.search(pattern, device_name):
            return part, peaks[DTYPES.index(dtype)]
    return None


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
