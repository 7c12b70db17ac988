"""Naive ("vertical") model parallel in one process: consecutive blocks on consecutive devices.

`--strategy layer-split --devices cuda:0,cuda:1` puts the embeddings and the first
blocks on cuda:0, the next blocks on cuda:1, and so on; activations move across
at the boundaries. A model larger than one device then runs at all, but only one
device works at a time. `--split-size N` cuts each micro-batch into chunks of N
sequences that flow through the devices like a pipeline: while device 1 runs
chunk i, device 0 already runs chunk i + 1 (CUDA launches kernels
asynchronously, so they overlap). On CPU devices the chunks run one after the
other: the same numbers, no overlap, which is what makes it testable anywhere.

The model stays one model (its modules only move), so checkpoints and export see it as usual.
engines/layer_split.py steps it.
"""

from __future__ import annotations

import torch

from meshlm.data.batch import Batch
from meshlm.errors import MeshlmError
from meshlm.models.families import pipeline_parts
from meshlm.models.stages import Stage, build_stages, parse_split


def parse_devices(spec: str) -> list[torch.device]:
    """The --devices list, checked: at least two, each one that exists here."""
    if not spec:
        raise MeshlmError("--strategy layer-split needs --devices, e.g. --devices cuda:0,cuda:1 (or cpu,cpu)")
    try:
        devices = [torch.device(d.strip()) for d in spec.split(",")]
    except RuntimeError:
        raise MeshlmError(
            f"--devices must be comma-separated devices such as cuda:0,cuda:1 or cpu,cpu; got {spec!r}"
        ) from None
    if len(devices) < 2:
        raise MeshlmError(f"--strategy layer-split needs at least two --devices, got {spec!r}")
    for d in devices:
        if d.type not in ("cpu", "cuda"):
            raise MeshlmError(f"--devices: {d} is neither cpu nor cuda:N")
        if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
            raise MeshlmError(f"--devices names {d}, but {torch.cuda.device_count()} CUDA device(s) are visible")
    return devices


def check_layer_split(cfg, model_config) -> None:
    """One-line errors before the model is built: devices that do not exist, more devices than layers."""
    n, layers = len(parse_devices(cfg.devices)), model_config.num_hidden_layers
    pipeline_parts(model_config, "layer split")
    if n > layers:
        raise MeshlmError(f"--devices lists {n} devices but the model has {layers} layers; list at most {layers}")
    if cfg.parallel.pp_split:
        parse_split(cfg.parallel.pp_split, n, layers)


def place(model: torch.nn.Module, devices: list[torch.device], split: str = "") -> list[Stage]:
    """Cut `model` into one stage per device (balanced by parameters, or at `split`) and move each there."""
    stages = build_stages(model, len(devices), split)
    # Last stage first: a head tied to the embedding then ends up with the embedding on the first device
    # (the stage moves its hidden states to the head's device).
    for stage, device in reversed(list(zip(stages, devices))):
        if any(p.is_meta for p in stage.parameters()):  # built on meta: allocate here, filled afterwards
            stage.to_empty(device=device)
        else:
            stage.to(device)
    return stages


def forward_chunks(stages: list[Stage], devices: list[torch.device], chunks: list[Batch]) -> list[torch.Tensor]:
    """Run every chunk through every stage in wavefront order: at tick t stage s takes chunk t - s, so
    consecutive devices hold consecutive chunks at the same time. Returns the last stage's outputs.
    Every stage gets the chunk's position ids: each builds the document-aware mask from them."""
    acts = [c.ids for c in chunks]
    for tick in range(len(chunks) + len(stages) - 1):
        for s in reversed(range(len(stages))):  # launch the later stage first: its input is already there
            c = tick - s
            if 0 <= c < len(chunks):
                acts[c] = stages[s](
                    acts[c].to(devices[s], non_blocking=True),
                    position_ids=chunks[c].positions.to(devices[s], non_blocking=True),
                )
    return acts
