"""The layer-split engine: one process, the model's stages on --devices (parallel/layer_split.py `place`),
each micro-batch's chunks run through them in wavefront order (`forward_chunks`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.data.batch import Batch
from meshlm.engines.base import Engine, EngineOptions
from meshlm.parallel.layer_split import forward_chunks, parse_devices, place


@dataclass(frozen=True)
class LayerSplitOptions(EngineOptions):
    devices: str = ""  # --devices, e.g. "cuda:0,cuda:1"
    split: str = ""  # --parallel.pp-split: first layer of each device after the first (default: balanced)
    split_size: int = 0  # --split-size: sequences per chunk (0: the whole micro-batch)

    @classmethod
    def of(cls, cfg) -> LayerSplitOptions:
        return super().of(cfg, devices=cfg.devices, split=cfg.parallel.pp_split, split_size=cfg.split_size)


class LayerSplitEngine(Engine):
    name = "layer-split"

    def __init__(self, model, layout, rt, options: LayerSplitOptions):
        super().__init__(model, layout, rt, options)
        self.devices = parse_devices(options.devices)
        self.stages = place(model, self.devices, options.split)
        self.split_size = options.split_size

    def outputs(self, batch: Batch, fn) -> list:
        batch = batch.to(self.devices[0])
        chunks = batch.split(self.split_size) if self.split_size else [batch]
        with self.autocast():
            logits = forward_chunks(self.stages, self.devices, chunks)
        # One result per chunk (the engine adds losses up and divides by the global count), on the main device.
        return [fn(out, c.to(out.device)).to(self.rt.device) for out, c in zip(logits, chunks)]
