"""The accelerators meshlm knows, in one table: memory, dense peak FLOP/s per precision (NVIDIA's datasheets,
without 2:4 sparsity) and HBM bandwidth. Metrics read it for MFU (by the name CUDA gives the part), the planner
for a cluster (by its --gpu name).

Part names are matched most specific first: "H100 PCIe" and "H100 NVL" before "H100", "L40S" and "L40" before
"L4" (as whole words: "NVIDIA L40" is not an L4).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

T = 1e12
GiB = 2**30


@dataclass(frozen=True)
class Gpu:
    part: str  # as MFU's log names it
    pattern: str  # on torch.cuda.get_device_name ("": the row of a part another row matches)
    fp32: float
    tf32: float
    bf16: float
    name: str = ""  # the planner's --gpu name ("": not offered to the planner)
    memory: int = 0  # bytes, for the planner
    hbm: float = 0.0  # bytes/s, for the planner
    float8: float = 0.0  # dense float8 tensor-core FLOP/s (compute capability 8.9+; the A100 has none)
    pcie_only: bool = False  # no NVLink between a node's GPUs: they talk over PCIe
    # the planner's rounded figures where they differ from MFU's (989e12 beside 989.4e12): plans stay as they were
    plan_bf16: float = 0.0
    plan_fp32: float = 0.0


TABLE = (
    Gpu("H100 PCIe", r"\bH100\b.*\bPCIe\b", 51.2 * T, 378 * T, 756 * T),
    Gpu("H100 NVL", r"\bH100\b.*\bNVL\b", 60 * T, 417.5 * T, 835 * T),
    Gpu("H100 SXM", r"\bH100\b", 66.9 * T, 494.7 * T, 989.4 * T, "h100", 80 * GiB, 3.35e12, 1979e12,
        plan_bf16=989e12, plan_fp32=67e12),
    Gpu("H200 NVL", r"\bH200\b.*\bNVL\b", 60 * T, 417.5 * T, 835 * T),
    Gpu("H200 SXM", r"\bH200\b", 66.9 * T, 494.7 * T, 989.4 * T, "h200", 141e9, 4.8e12, 1979e12,
        plan_bf16=989e12, plan_fp32=67e12),
    Gpu("B200", r"\bB200\b", 80 * T, 1100 * T, 2250 * T),
    Gpu("A100", r"\bA100\b", 19.5 * T, 156 * T, 312 * T, "a100-80gb", 80 * GiB, 2.0e12),
    Gpu("A100", "", 19.5 * T, 156 * T, 312 * T, "a100-40gb", 40 * GiB, 1.56e12),
    Gpu("L40S", r"\bL40S\b", 91.6 * T, 183 * T, 362 * T, "l40s", 48 * GiB, 0.86e12, 733e12, pcie_only=True),
    Gpu("L40", r"\bL40\b", 90.5 * T, 90.5 * T, 181 * T),
    Gpu("L4", r"\bL4\b", 30.3 * T, 60 * T, 121 * T, "l4", 24 * GiB, 0.3e12, 242e12, pcie_only=True),
    Gpu("A10G", r"\bA10G\b", 31.2 * T, 62.5 * T, 125 * T),
    Gpu("A10", r"\bA10\b", 31.2 * T, 62.5 * T, 125 * T),
    Gpu("RTX 4090", r"\bRTX 4090\b", 82.6 * T, 82.6 * T, 165.2 * T),
)  # fmt: skip
DTYPES = ("fp32", "tf32", "bf16")

# The planner's view, by --gpu name: (memory bytes, dense bf16 FLOP/s, fp32 FLOP/s without TF32, HBM bytes/s)
GPUS = {g.name: (g.memory, g.plan_bf16 or g.bf16, g.plan_fp32 or g.fp32, g.hbm) for g in TABLE if g.name}
# float8 FLOP/s of the GPUs with float8 tensor cores: what --float8's Linear layers compute at
FLOAT8_FLOPS = {g.name: g.float8 for g in TABLE if g.name and g.float8}
PCIE_ONLY = tuple(g.name for g in TABLE if g.name and g.pcie_only)  # --intra-node's default follows --gpu


def known_peak(device_name: str, dtype: str) -> tuple[str, float] | None:
    """(part, peak FLOP/s) of a GPU name in `dtype`, or None for a part not in the table."""
    for g in TABLE:
        if g.pattern and re.search(g.pattern, device_name):
            return g.part, getattr(g, dtype)
    return None
