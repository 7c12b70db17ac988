"""Throughput, MFU, memory, and the sinks metrics go to (metrics.jsonl, TensorBoard, W&B, the console's progress
bar)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshlm.runtime import Runtime, log

if TYPE_CHECKING:
    from meshlm.config import Config


@dataclass(frozen=True)
class Flops:
    """A training step's FLOPs: 6N per token for the weights (forward + backward, embeddings excluded) and
    12 * layers * hidden per (query, key) score for attention (QK^T and AV, forward + backward; PaLM appendix B).

    `dense_per_token` is PaLM's figure, every token against all `seq_length` keys (`mfu_dense`, what `mfu` once
    was); `mfu` counts the scores each packed document needs, n(n+1)/2 for a document of n tokens
    (causal, within itself: a block of one document needs (S+1)/2 keys per token, not S), so a kernel that
    skips masked scores never looks better than the work it did. Likewise the LM head's share (`head_per_token`,
    6 x its parameters where they are counted: an untied head) counts in `mfu` only for positions with a target:
    the others need no logits (parallel/loss.py skips them); `mfu_dense` counts every token.
    """

    weights_per_token: float
    per_score: float
    seq_length: int
    head_per_token: float = 0.0

    @property
    def dense_per_token(self) -> float:
        return self.weights_per_token + self.per_score * self.seq_length


def train_flops(model_config, num_params: int, embedding_params: int, seq_length: int, head_params: int = 0) -> Flops:
    """`head_params`: the LM head's parameters where num_params counts them (0 for a head tied to the embedding)."""
    per_score = 12 * model_config.num_hidden_layers * model_config.hidden_size
    return Flops(6 * (num_params - embedding_params), per_score, seq_length, 6 * head_params)


def document_scores(positions: torch.Tensor) -> int:
    """The (query, key) scores causal attention within each packed document needs: sum of n(n+1)/2."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    lengths = torch.unique_consecutive(starts.reshape(-1).cumsum(0), return_counts=True)[1]
    return int((lengths * (lengths + 1) // 2).sum())


@functools.cache
def _measure_peak(device: torch.device, dtype: str, rounds: int = 3, reps: int = 3) -> float:
    """FLOP/s of a square matmul in `dtype`, the best of `rounds` timings: other load only ever slows a round down.
    Once per process: a process that runs several jobs in turn (the Python API, a notebook) pays it once."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    return best


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


def peak_flops(device: torch.device, cache: Path, dtype: str = "fp32") -> float:
    """Peak FLOP/s of one device in the compute dtype (meshlm/hardware.py): a known GPU part's datasheet figure,
    or else the fastest matmul measured here.

    Measured once in each process (about 40 ms on a CPU core) and kept, under the device's name (a GPU's)
    or thread count (a CPU's) and the dtype, as the highest ever seen: a measurement taken while other
    jobs shared the device is too low, and an MFU computed from it too high, so a later, faster
    measurement replaces it.
    """
    if device.type == "cuda":
        from meshlm.hardware import known_peak  # the datasheet table names GPU parts only

        name = torch.cuda.get_device_name(device)
        known = known_peak(name, dtype)
        if known:
            return known[1]
        key = f"cuda-{name}-{dtype}"
    else:
        key = f"cpu-{torch.get_num_threads()}threads-{dtype}"
    path = cache / "peak_flops.json"
    try:
        seen = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        seen = {}
    measured = _measure_peak(device, dtype)
    if measured > seen.get(key, 0.0):
        seen[key] = measured
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(seen))
        os.replace(tmp, path)
    return seen[key]


class Sinks:
    """metrics.jsonl and TensorBoard on rank 0; W&B on every rank (one run per rank, grouped)."""

    def __init__(self, cfg, rt: Runtime, out: Path, start_step: int = 0):
        """start_step: the step the run resumes from; what a sink holds past it is replaced (metrics.jsonl's rows
        were dropped by checkpoint/run_dir.py)."""
        self.rt = rt
        self.file = open(out / "metrics.jsonl", "a") if rt.is_main else None
        self.tb = None
        if cfg.tensorboard and rt.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1)
        self.wandb = None
        if cfg.wandb:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(
                project=cfg.wandb_project,
                group=cfg.experiment_name,
                name=f"rank-{rt.rank}",
                id=f"{cfg.experiment_name}-rank{rt.rank}",
                resume="allow",
                mode=mode,
                dir=str(out),
                config={"rank": rt.rank, "world_size": rt.world_size},
            )

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

    def __init__(self, device: torch.device, tokens_per_step: int, flops: Flops, peak: float, world: int):
        self.tokens_per_step, self.flops = tokens_per_step, flops
        self.peak, self.world = peak, world
        self.loss_sum = torch.zeros((), device=device)
        self.steps, self.scores, self.tokens, self.targets = 0, 0, 0, 0
        self.restart_clock()

    def restart_clock(self) -> None:
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, micro: list) -> None:
        """One step: its loss, and the document scores of this rank's micro-batches (standing for the global
        batch's: the row's `mfu` uses their scores per token)."""
        self.loss_sum += loss
        self.steps += 1
        for batch in micro:
            self.scores += document_scores(batch.positions)
            self.tokens += batch.positions.numel()
            self.targets += batch.targets()  # a tensor where the labels are: read once a row

    def row(self, step: int, mean_loss: float, lr: float, grad_norm: float, extra: dict) -> dict:
        dt = time.perf_counter() - self.t0
        tps = self.tokens_per_step * self.steps / dt
        row = {
            "step": step,
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "tokens_per_s_per_rank": tps / self.world,
            "mfu": tps * self.flops_per_token() / self.peak,
            "mfu_dense": tps * self.flops.dense_per_token / self.peak,
            "step_time_s": dt / self.steps,
            **extra,
        }
        self.steps, self.scores, self.tokens, self.targets = 0, 0, 0, 0
        self.loss_sum.zero_()
        self.restart_clock()
        return row

    def flops_per_token(self) -> float:
        """What the window's documents required per token: attention within each document, the LM head for the
        positions with a target."""
        untargeted = 1 - float(self.targets) / self.tokens
        weights = self.flops.weights_per_token - self.flops.head_per_token * untargeted
        return weights + self.flops.per_score * self.scores / self.tokens


def job_peak_flops(cfg, rt: Runtime, strategy: str, cache: Path) -> float:
    """The whole job's peak: one device's, in the compute dtype, times the devices each process drives
    (nn.DataParallel and layer-split drive several from one process) times the processes."""
    dtype = compute_dtype(cfg.mixed_precision, rt.device)
    per_process = devices_driven(strategy, rt.device, cfg.devices)
    return peak_flops(rt.device, cache, dtype) * per_process * rt.world_size


def lines_above(bar):
    """While the progress bar shows, log lines (saved, eval_loss) are printed above it, each on its own line."""
    if bar is None:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[log])


def progress_bar(cfg: Config, rt: Runtime, initial: int):
    if not (cfg.progress and rt.is_main):
        return None
    import os
    import sys
    import threading

    from tqdm import tqdm

    if os.environ.get("MESHLM_LAUNCHED"):
        # tqdm's default lock holds a multiprocessing one: in a rank of meshlm's launcher (forkserver context) a
        # named semaphore, which the launcher's resource tracker reports as leaked when an interrupted rank leaves
        # without finalisation (runtime.leave_rank); one process draws the bar, so a thread lock is all it needs
        tqdm.set_lock(threading.RLock())
    return tqdm(
        total=cfg.max_steps,
        initial=initial,
        desc="train",
        file=sys.stdout,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stdout.isatty() else 10,
    )
