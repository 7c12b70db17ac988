"""Throughput, MFU, memory, and the sinks metrics go to (metrics.jsonl, TensorBoard, W&B)."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

from meshlm.runtime import Runtime

# Dense bf16 peak FLOP/s (no sparsity) of GPUs we know; others fall back to a matmul measurement.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
                 "L4": 121e12, "RTX 4090": 165e12, "V100": 125e12}


def train_flops_per_token(model_config, num_params: int, embedding_params: int, seq_length: int) -> float:
    """6N for the weights (forward + backward) plus attention's 12 * layers * hidden * seq (PaLM appendix B)."""
    layers = model_config.num_hidden_layers
    hidden = model_config.hidden_size
    return 6 * (num_params - embedding_params) + 12 * layers * hidden * seq_length


def _measure_peak(device: torch.device, rounds: int = 3, reps: int = 3) -> float:
    """FLOP/s of a square matmul, the best of `rounds` timings: other load only ever slows a round down."""
    n = 2048 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    return best


def peak_flops(device: torch.device, cache: Path) -> float:
    """Peak FLOP/s of one rank's device: a known GPU's bf16 figure, or else the fastest matmul measured here.

    Measured at every start (about 40 ms on a CPU core) and kept as the highest ever seen for this device
    and thread count: a measurement taken while other jobs shared the cores is too low, and an MFU
    computed from it too high, so a later, faster measurement replaces it.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for k, v in GPU_PEAK_BF16.items():
            if k in name:
                return v
    key = f"{device.type}-{torch.get_num_threads()}threads"
    path = cache / "peak_flops.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    measured = _measure_peak(device)
    if measured > known.get(key, 0.0):
        known[key] = measured
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)
    return known[key]


def memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem_allocated_bytes": torch.cuda.memory_allocated(device),
                "mem_reserved_bytes": torch.cuda.memory_reserved(device),
                "mem_peak_bytes": torch.cuda.max_memory_allocated(device)}
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"mem_rss_bytes": rss, "mem_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class Sinks:
    """metrics.jsonl and TensorBoard on rank 0; W&B on every rank (one run per rank, grouped)."""

    def __init__(self, cfg, rt: Runtime, out: Path):
        self.rt = rt
        self.file = open(out / "metrics.jsonl", "a") if rt.is_main else None
        self.tb = None
        if cfg.tensorboard and rt.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        self.wandb = None
        if cfg.wandb:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=cfg.wandb_project, group=cfg.experiment_name, name=f"rank-{rt.rank}",
                                    id=f"{cfg.experiment_name}-rank{rt.rank}", resume="allow", mode=mode,
                                    dir=str(out), config={"rank": rt.rank, "world_size": rt.world_size})

    def log(self, row: dict) -> None:
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])
        if self.wandb:
            self.wandb.log(row, step=row["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


class LogWindow:
    """The steps since the last metrics row: their loss summed on the device (no host sync per step) and
    their wall time, turned into a row for the sinks."""

    def __init__(self, device: torch.device, tokens_per_step: int, flops_per_token: float, peak: float, world: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.world = peak, world
        self.loss_sum = torch.zeros((), device=device)
        self.steps = 0
        self.restart_clock()

    def restart_clock(self) -> None:
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.steps += 1

    def row(self, step: int, mean_loss: float, lr: float, grad_norm: float, extra: dict) -> dict:
        dt = time.perf_counter() - self.t0
        tps = self.tokens_per_step * self.steps / dt
        row = {"step": step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
               "tokens_per_s_per_rank": tps / self.world, "mfu": tps * self.flops_per_token / self.peak,
               "step_time_s": dt / self.steps, **extra}
        self.steps = 0
        self.loss_sum.zero_()
        self.restart_clock()
        return row
