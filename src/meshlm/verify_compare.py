"""`meshlm verify`'s comparison: a layout's losses, gradient norms, final parameters and model state against
the single-process reference, and the verdict (see verify.py for what each column measures)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshlm.verify_cases import Case

# What the comparison tolerates in fp32. Runs differ only in the order of floating-point
# reductions (all-reduce, sharded matmuls), which AdamW then amplifies a little per step.
TOLERANCE = {"loss": 1e-4, "grad_norm": 1e-3, "params": 1e-3, "rewards": 1e-4}
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass
class Row:
    layout: str
    ranks: int
    status: str = ""  # reference | ok | FAIL | error: ... | not available: ...
    loss: float = math.nan
    grad_norm: float = math.nan
    params: float = math.nan
    state: float = math.nan  # rank 0's model state bytes / the reference's
    rewards: float = math.nan  # --objective dpo: the rewards' difference (scaled_diff)
    seconds: float = math.nan
    losses: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    @property
    def available(self) -> bool:
        return not self.status.startswith("not available")


def max_rel(a: list[float], b: list[float]) -> float:
    """max |a - b| / |b| over the pairs; NaN when any pair gives NaN (a NaN or inf on either side) or the lengths
    differ, so that `not value <= tol` fails it. (Python's max() skips a NaN that does not come first.)"""
    if len(a) != len(b):
        return math.nan
    diffs = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=math.nan)


def scaled_diff(a: list[float], b: list[float]) -> float:
    """max |a - b| / max |b|: for values that start at exactly 0 (DPO's rewards, policy = reference). NaN as
    max_rel's: a NaN on either side or lengths that differ."""
    if len(a) != len(b):
        return math.nan
    diffs = [abs(x - y) for x, y in zip(a, b)]
    if any(math.isnan(d) for d in diffs):
        return math.nan
    return max(diffs, default=math.nan) / (max(abs(y) for y in b) or 1.0)


def param_diff(ref: dict, other: dict, start=None) -> tuple[float, str]:
    """max over tensors of ||a - b|| / ||b - b0||, and a problem ('' if none) when names or shapes differ.

    b0 is `start(name, b)`, the tensor's value before training, or zero when that gives None: the difference
    is measured against how far training moved the tensor, so an update that did not happen (or a gradient
    left unreduced) is a difference near 1 even where the tensor is large and moved little. In norm, not
    element by element: AdamW's first steps turn rounding-level differences of a gradient element that is
    zero in exact arithmetic (a key bias: softmax ignores a shift shared by every key) into updates near its
    eps, of either sign, a sizeable part of the largest update of a tensor that starts at zero.
    NaN anywhere gives NaN."""
    if ref.keys() != other.keys():
        missing, extra = sorted(ref.keys() - other.keys()), sorted(other.keys() - ref.keys())
        return math.inf, f"parameter names differ (missing {missing[:3]}, extra {extra[:3]})"
    diffs = []
    for k, b in ref.items():
        a = other[k]
        if a.shape != b.shape:
            return math.inf, f"{k} has shape {tuple(a.shape)}, the reference {tuple(b.shape)}"
        b0 = start(k, b) if start is not None else None
        moved = b.float() - b0.float() if b0 is not None and b0.shape == b.shape else b.float()
        scale = moved.norm().item() or b.float().norm().item() or 1.0
        diffs.append((a.float() - b.float()).norm().item() / scale)
    return (math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)), ""


def compare(
    row: Row,
    ref_rows: list[dict],
    rows: list[dict],
    ref_params: dict,
    params: dict,
    case: Case,
    tol: dict,
    start=None,
) -> Row:
    """Fill the row's differences from the reference and decide ok / FAIL (`start`: param_diff's)."""
    if [r["step"] for r in rows] != [r["step"] for r in ref_rows]:
        row.problems.append(f"logged steps {[r['step'] for r in rows]} differ from the reference's")
    row.losses = [r["loss"] for r in rows]
    # GRPO's loss is near 0 on-policy (advantages of mean 0): measured against its largest value, as DPO's rewards
    loss_diff = scaled_diff if "reward" in ref_rows[0] else max_rel
    row.loss = loss_diff(row.losses, [r["loss"] for r in ref_rows])
    row.grad_norm = max_rel([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows])
    row.params, problem = param_diff(ref_params, params, start)
    if problem:
        row.problems.append(problem)
    row.state = rows[0]["model_state_bytes"] / ref_rows[0]["model_state_bytes"]
    checked = ["loss", "grad_norm", "params"]
    if REWARDS[0] in ref_rows[0]:
        row.rewards = max(scaled_diff([r[k] for r in rows], [r[k] for r in ref_rows]) for k in REWARDS)
        checked.append("rewards")
    for name in checked:
        value = getattr(row, name)
        if not value <= tol[name]:  # NaN fails too
            row.problems.append(f"{name.replace('_', '-')} difference {value:.3g} > {tol[name]:g}")
    if case.layout.shards_state and row.state > 0.99:
        row.problems.append(f"rank 0 holds {row.state:.2f} of the reference's model state: nothing was sharded")
    row.status = "FAIL" if row.problems else "ok"
    return row
