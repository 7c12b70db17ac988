"""`meshlm env`: what a bug report needs (versions, devices, backends, launcher)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys

from meshlm import versions

# What meshlm runs on and what it uses when asked (peft: --lora.r; matplotlib: report, --plot, --trace-pipeline;
# torchao: --float8).
PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "peft",
    "datasets",
    "matplotlib",
    "accelerate",
    "tensorboard",
    "wandb",
    "torchao",
)


def report() -> str:
    import torch
    import torch.distributed as dist

    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    lines = [
        f"meshlm        {version('meshlm')}",
        f"python        {sys.version.split()[0]} ({sys.executable})",
        f"platform      {platform.platform()}",
    ]
    for pkg in PACKAGES:
        standing = f" ({versions.standing(pkg)})" if pkg in versions.OLDEST else ""
        lines.append(f"{pkg:<13} {version(pkg)}{standing}")
    lines.append(f"cpu cores     {os.cpu_count()} (torch threads {torch.get_num_threads()})")
    if torch.cuda.is_available():
        lines.append(f"cuda          {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i}      {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
    else:
        lines.append("cuda          not available (CPU ranks with gloo)")
    backends = [
        b
        for b, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    lines.append(f"backends      {', '.join(backends) or 'none'}")
    torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
    lines.append(f"torchrun      {torchrun}")
    return "\n".join(lines)
