"""The cluster the planner prices: nodes, GPUs (meshlm/hardware.py's table), the links between them, and the
parsing of sizes, rates and FLOP/s its options take."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from meshlm.errors import MeshlmError
from meshlm.hardware import FLOAT8_FLOPS, GPUS, PCIE_ONLY

# Achievable bytes/s per GPU on a ring step (bus bandwidth), and a latency per collective call.
LINKS = {
    "nvlink": (300e9, 10e-6),  # NVLink 4 (H100): 450 GB/s per direction, ~300 reached by NCCL rings
    "pcie": (24e9, 15e-6),  # PCIe 4.0 x16
    "infiniband": (45e9, 25e-6),  # one 400 Gb/s NDR NIC per GPU (DGX H100 layout)
    "ethernet": (12e9, 50e-6),  # 100 GbE per GPU
}

# --device cpu: the ranks are gloo processes of one machine, talking over loopback TCP (a rough rate and latency),
# their optimizer steps reading RAM (a rough rate for a desktop's DDR4/DDR5)
CPU_LINK = (2e9, 50e-6)
CPU_RAM_BYTES_PER_S = 20e9


def cpu_device(ranks: int) -> tuple[int, float]:
    """(memory, fp32 FLOP/s) of one of `ranks` CPU ranks on this machine: its share of the machine's RAM, and the
    fp32 matmul rate measured here with the threads a rank gets (CPU ranks compute in fp32; bf16 is no faster)."""
    import os
    import time

    import torch

    from meshlm.launch import threads_per_rank

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
    threads, n = torch.get_num_threads(), 512
    torch.set_num_threads(threads_per_rank(ranks))
    try:
        a = torch.randn(n, n)
        best = math.inf
        for _ in range(5):  # the best of a few: a loaded machine's slowest runs say little about its rate
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return memory, 2 * n**3 / best


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(option: str, text: str) -> int:
    """'80GiB', '80GB', '80e9', '1.5TiB' -> bytes; anything else is a one-line error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise MeshlmError(f"{option}: cannot read {text!r} as a size; use e.g. 80GiB, 80GB or 80e9")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bandwidth(option: str, text: str) -> tuple[float, float]:
    """A preset (nvlink, pcie, infiniband, ethernet) or bytes/s: '50GB/s', '400Gb/s', '400Gbps', '50e9'.
    Returns (bytes/s, latency per collective call in seconds)."""
    t = str(text).strip()
    if t.lower() in LINKS:
        return LINKS[t.lower()]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(B|b|bit|bps)?(/s)?", t)
    if not m or float(m.group(1)) <= 0:
        raise MeshlmError(
            f"{option}: cannot read {text!r}; use {', '.join(LINKS)} or a rate such as 50GB/s, "
            f"400Gb/s or 50e9 (bytes/s)"
        )
    rate = float(m.group(1)) * _UNITS[m.group(2).lower()]
    bits = m.group(3) in ("b", "bit", "bps")
    return (rate / 8 if bits else rate), LINKS["infiniband"][1]


def parse_flops(option: str, text: str) -> float:
    """'989e12', '989T', '989TFLOPS', '989 TFLOP/s' -> FLOP/s."""
    m = re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtTpP]?)(?:FLOPS|FLOP/s|flops|flop/s)?\s*", str(text)
    )
    if not m or float(m.group(1)) <= 0:
        raise MeshlmError(f"{option}: cannot read {text!r} as FLOP/s; use e.g. 989e12 or 989T")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}[m.group(2).lower()]


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "h100"
    gpu_memory: int = GPUS["h100"][0]
    peak_flops: float = GPUS["h100"][1]  # per GPU, for the job's precision
    float8_flops: float = FLOAT8_FLOPS["h100"]  # per GPU, float8 matmuls (--float8); 0: none
    hbm_bw: float = GPUS["h100"][3]
    intra: tuple = LINKS["nvlink"]  # (bytes/s, latency) between GPUs of a node
    inter: tuple = LINKS["infiniband"]  # between nodes
    host: tuple = LINKS["pcie"]  # GPU <-> CPU (offload)
    cpu_memory: int = 2 * 2**40  # per node

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def make_cluster(
    nodes=1,
    gpus_per_node=8,
    gpu="h100",
    gpu_memory=None,
    peak_flops=None,
    intra="",
    inter="infiniband",
    cpu_memory="2TiB",
    precision="bf16",
) -> Cluster:
    if gpu == "cpu":  # --device cpu
        mem, fp32 = cpu_device(nodes * gpus_per_node)
        return Cluster(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            gpu=gpu,
            gpu_memory=parse_size("--gpu-memory", gpu_memory) if gpu_memory else mem,
            peak_flops=parse_flops("--peak-flops", peak_flops) if peak_flops else fp32,
            float8_flops=0.0,
            hbm_bw=CPU_RAM_BYTES_PER_S,
            intra=CPU_LINK,
            inter=parse_bandwidth("--inter-node", inter),
            cpu_memory=mem,
        )
    if gpu not in GPUS:
        raise MeshlmError(
            f"--gpu must be one of {', '.join(GPUS)}, got {gpu!r} (or give --gpu-memory and --peak-flops)"
        )
    if nodes < 1 or gpus_per_node < 1:
        raise MeshlmError("--nodes and --gpus-per-node must be at least 1")
    mem, bf16, fp32, hbm = GPUS[gpu]
    return Cluster(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        gpu_memory=parse_size("--gpu-memory", gpu_memory) if gpu_memory else mem,
        peak_flops=parse_flops("--peak-flops", peak_flops) if peak_flops else (bf16 if precision == "bf16" else fp32),
        float8_flops=FLOAT8_FLOPS.get(gpu, 0.0),
        hbm_bw=hbm,
        intra=parse_bandwidth("--intra-node", intra or ("pcie" if gpu in PCIE_ONLY else "nvlink")),
        inter=parse_bandwidth("--inter-node", inter),
        cpu_memory=parse_size("--cpu-memory", cpu_memory),
    )
