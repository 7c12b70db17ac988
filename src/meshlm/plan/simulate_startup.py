"""The start-up peak of one rank on fake tensors: `meshlm plan --simulate`'s "start-up peak" row.

A rank starts as `meshlm train` starts it: build_model on the meta device (no memory), then meshlm's
parallelize with the layout's options, which fills the rank's part with models/materialize.py (to_empty,
then one tensor at a time: the full value drawn on the CPU by the name-seeded initializer, this rank's
slice kept) and builds the engine around it (DDP's gradient buckets, the bf16 master-weight engine's
masters and casts). Here materialize runs on fake tensors (shapes, no memory) while live_bytes.LiveBytes
counts every storage, so the peak is the real code's, op by op, for a model of any size.

Where fake tensors start: everything before materialize (LoRA, the pipeline split, TP, FSDP, the meta copy
materialize draws from) runs on the meta model, as in `meshlm train`; FSDP, TP and the pipeline split need
real DeviceMesh arithmetic there. From materialize on, the rank holds storage: DDP and the master-weight
engine, built after it, read their parameters, so for them fake tensors stay on until the engine exists.
Meta tensors hold no memory and are not counted. The plan's number (memory.startup_bytes) is this rank's
parameters as allocated (fp32, or LoRA's stored base) plus the largest full tensor; the rows say what the engine
adds after materializing.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

MATERIALIZE, WRAP = "materialize", "wrap"


@contextlib.contextmanager
def _counted_fill(live, fake, keep: bool):
    """parallelize's `fill`: materialize run under `fake` with `live` counting it (LiveBytes above
    FakeTensorMode, so it sees each op's fake outputs); with `keep`, both stay on until this block ends (the
    engine is built after it)."""
    from meshlm.models.materialize import materialize

    with contextlib.ExitStack() as counting:

        def counted(*args, **kwargs):
            counting.enter_context(fake)
            counting.enter_context(live)
            live.phase = MATERIALIZE
            materialize(*args, **kwargs)
            live.phase = WRAP
            if not keep:
                counting.close()

        yield counted


def startup_peak(cfg, vocab, rank: int, world: int, fake_rank) -> dict:
    """{'materialize': peak bytes while materializing, 'startup': peak until the engine is built}; `fake_rank`:
    the simulation's fake process group of `world` ranks (plan/simulate.py), `vocab`: what build_model reads."""
    from meshlm.compat import FakeTensorMode
    from meshlm.layout import resolve
    from meshlm.models.build import build_model
    from meshlm.parallel.apply import parallelize
    from meshlm.plan.live_bytes import LiveBytes
    from meshlm.plan.simulate_standins import SIMULATED, reads_values_when_built
    from meshlm.runtime import Runtime

    rt = Runtime(rank=rank, world_size=world, device=torch.device("cpu"), backend="fake")
    live = LiveBytes()
    with fake_rank(rank, world):
        model = build_model(cfg, vocab, "meta")
        layout = resolve(cfg, world, model.config)
        eager = reads_values_when_built(layout)
        with _counted_fill(live, FakeTensorMode(allow_non_fake_inputs=True), keep=eager) as fill:
            engine = parallelize(model, cfg, rt, layout, dataclasses.replace(SIMULATED, fill=fill))
        del engine, model
    return {"materialize": live.phase_peaks.get(MATERIALIZE, 0), "startup": max(live.phase_peaks.values(), default=0)}


def planned_startup(spec, job, e, stage: int) -> int:
    """The plan's start-up peak of a rank of pipeline stage `stage` (advisor's own accounting)."""
    from meshlm.plan import advisor
    from meshlm.plan.memory import startup_bytes

    st = advisor.stages(spec, e.candidate, 1)[stage]
    shard = advisor.startup_shard(job, e.candidate, st)
    return startup_bytes(spec, job, st, shard, False, *advisor.startup_engine(job, e.candidate, st))
