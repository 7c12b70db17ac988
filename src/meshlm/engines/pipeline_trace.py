"""How a pipeline's stages are measured: the time each computes (`StageClock`, against the step time: the bubble the
engine reports) and `--trace-pipeline`'s record of every action's start and end (`PipelineTrace`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.runtime import log


class StageClock:
    """Adds up intervals: wall time on CPU; CUDA events on GPU (no synchronisation until read). It also keeps
    the span from the first interval's start to the last one's end, until take_span."""

    def __init__(self, device: torch.device):
        self.cuda, self.seconds, self.events = device.type == "cuda", 0.0, []
        self.first = self.last = None

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, started) -> None:
        ended = self.start()
        self.add(started, ended)
        self.first = started if self.first is None else self.first
        self.last = ended

    def add(self, started, ended) -> None:
        if self.cuda:
            self.events.append((started, ended))
        else:
            self.seconds += ended - started

    def take_span(self) -> tuple:
        """(first start, last end) since the last call, (None, None) if nothing was timed."""
        span, self.first, self.last = (self.first, self.last), None, None
        return span

    def read_and_reset(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.events) / 1000
        total, self.seconds, self.events = self.seconds, 0.0, []
        return total


class PipelineTrace:
    """`--trace-pipeline`: while active (one step), every stage action's measured start and end.

    Wall-clock seconds (time.time), so the ranks of one host share a time axis; on several nodes
    the axes are only as aligned as the hosts' clocks (NTP: often a millisecond or more off). On
    CUDA each action is bracketed by a synchronize, so the times are its kernels' (this costs
    overlap, but only in the traced step)."""

    def __init__(self, engine):
        """`engine`: the PipelineEngine whose stages are traced."""
        self.engine, self.events = engine, []
        self.cuda = engine.rt.device.type == "cuda"

    def __enter__(self):
        for s in self.engine.stages:
            s.trace = self
        return self

    def __exit__(self, *exc):
        for s in self.engine.stages:
            s.trace = None

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.time()

    def add(self, stage: int, action: str, chunk: int, start: float) -> None:
        # Micro-batches count on across gradient-accumulation rounds: round r's chunk c is r x M + c.
        e = self.engine
        self.events.append(
            {
                "rank": e.rt.rank,
                "stage": stage,
                "micro_batch": e.round * e.m + chunk,
                "action": action,
                "start": start,
                "end": self.now(),
            }
        )

    def save(self, out: Path, step: int) -> None:
        """Gather the pipeline's events (collective over the pp group); the job's rank 0 writes
        trace/pipeline.json and draws plots/pipeline.png. Other pipelines (dp, tp > 1) run the same schedule."""
        e = self.engine
        everyone: list = [None] * e.pp
        dist.all_gather_object(everyone, self.events, group=e.pp_group)
        if not e.rt.is_main:
            return
        from meshlm.report import bubble_fraction, plot_pipeline_timeline

        events = sorted((ev for rank in everyone for ev in rank), key=lambda ev: (ev["rank"], ev["start"]))
        v = "V" if e.virtual > 1 else ""
        formula = (e.pp - 1) / (e.virtual * e.m + e.pp - 1)
        trace = {
            "step": step,
            "schedule": e.options.schedule,
            "pp": e.pp,
            "virtual_stages": e.virtual,
            "micro_batches": e.m,
            "grad_accum": e.options.grad_accum,
            "bubble_formula": formula,
            "bubble_measured": bubble_fraction(events),
            "clock": "time.time() seconds; ranks on different hosts may be skewed",
            "events": events,
        }
        (out / "trace").mkdir(exist_ok=True)
        (out / "trace" / "pipeline.json").write_text(json.dumps(trace, indent=1))
        title = (
            f"{trace['schedule']}, P={e.pp}{f', V={e.virtual}' if v else ''}, M={e.m}, step {step}: "
            f"bubble formula (P-1)/({v}M+P-1) = {formula:.1%}"
        )
        png = plot_pipeline_timeline(events, out / "plots" / "pipeline.png", title)
        log.info(
            f"pipeline trace: {out / 'trace' / 'pipeline.json'}, {png} (measured bubble "
            f"{trace['bubble_measured']:.1%}, formula {formula:.1%})"
        )
