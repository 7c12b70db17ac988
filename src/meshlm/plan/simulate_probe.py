"""The probe of `meshlm plan --validate` (train/probe.py) run on a simulated rank: its numbers for fake tensors.

`plan --validate` measures a real step with train/probe.py's Probe (MemTracker's activation peak, the
engine's model_state_bytes); running that same Probe around a step of the simulation gives the simulated
value of exactly the quantity measured, so the two can be compared one to one (plan/simulate_check.py). As
in the trainer, the measured step is not the first: one step runs before it (optimizer states created, DDP's
buckets rebuilt in the order backward used them) and gradients are dropped between the two
(zero_grad(set_to_none=True)); the trainer's non-finite check (`.item()` of the norm) needs a value and is left
out.
"""

from __future__ import annotations


def probed_steps(engine, optimizer, micro: list, grad_clip: float) -> dict:
    """Two training steps of `engine`, the second under the Probe: what the probe would write for this rank."""
    from meshlm.train.probe import Probe

    _one_step(engine, optimizer, micro, grad_clip)
    optimizer.zero_grad(set_to_none=True)
    with Probe(engine, optimizer) as probe:
        _one_step(engine, optimizer, micro, grad_clip)
    return probe.result


def _one_step(engine, optimizer, micro: list, grad_clip: float) -> None:
    engine.train_step(micro)
    engine.clip_grad_norm(grad_clip)
    optimizer.step()
