"""`meshlm plan --validate --simulate`: the simulation checked against real runs, rank by rank.

`plan --validate` runs each layout through the real trainer on this machine's ranks and its probe
(train/probe.py) writes, per rank, the model states and the activation peak of the measured step. For the
same layout and rank, the simulation (plan/simulate.py: meshlm's own build, parallelize and step on fake
tensors over a fake process group) runs that same probe (plan/simulate_probe.py), so each simulated number
is the measured quantity's counterpart. The validation's own targets apply (model states 3%, activation
peak 20%); a layout whose simulation misses them, or fails, fails the validation. CPU offload is not
simulated (meshlm builds it only with CUDA).
"""

from __future__ import annotations

from meshlm.plan import compare_table
from meshlm.plan.advisor import Estimate
from meshlm.plan.simulate import model_dir, not_simulated, simulate_rank, train_config

QUANTITIES = {"model states": "model_state_bytes", "activation peak": "activation_peak_bytes"}


def simulated_probes(spec, job, e: Estimate) -> list[dict]:
    """What the probe would write on every rank of layout e, from the simulation."""
    cfg = train_config(spec, job, e, model_dir(spec))
    return [simulate_rank(spec, cfg, rank, e.candidate.world, probe=True) for rank in range(e.candidate.world)]


def compare(measured: list[dict], simulated: list[dict], targets: dict[str, float]) -> list[dict]:
    """Per quantity, the rank where simulation and measurement differ most: (simulated, measured, ratio)."""
    sims = {s["rank"]: s for s in simulated}
    worst: dict[str, dict] = {}
    for m in measured:
        for quantity, key in QUANTITIES.items():
            sim, real = sims[m["rank"]][key], m[key]
            ratio = sim / real if real else float("inf")
            row = {
                "quantity": quantity,
                "rank": m["rank"],
                "simulated": sim,
                "measured": real,
                "ratio": ratio,
                "target": targets[quantity],
                "ok": abs(ratio - 1) <= targets[quantity],
            }
            if quantity not in worst or abs(ratio - 1) > abs(worst[quantity]["ratio"] - 1):
                worst[quantity] = row
    return list(worst.values())


def add_simulated(spec, job, ests: list[Estimate], results: list[dict], targets: dict[str, float]) -> None:
    """Each validated layout's result gets 'simulated' rows (or 'not_simulated', why); outside `targets` (the
    validation's own) fails it."""
    by_name = {e.candidate.name: e for e in ests}
    for r in results:
        e = by_name[r["layout"]]
        if "probes" not in r:  # the real run failed: nothing to compare with
            continue
        if why := not_simulated(e, job):
            r["not_simulated"] = why
            continue
        try:
            r["simulated"] = compare(r["probes"], simulated_probes(spec, job, e), targets)
        except Exception as err:  # a layout the simulation cannot run yet: say so, and fail the validation
            r["not_simulated"], r["ok"] = f"the simulation failed: {type(err).__name__}: {err}".splitlines()[0], False
            continue
        r["ok"] = r["ok"] and all(row["ok"] for row in r["simulated"])


def render(results: list[dict]) -> str:
    lines = compare_table.head(
        "simulated (fake tensors, the same probe) vs measured, bytes per rank; the rank furthest apart", "simulated"
    )
    for r in results:
        if "not_simulated" in r:
            lines.append(f"{r['layout']:<22} not simulated: {r['not_simulated']}")
        for row in r.get("simulated", []):
            flag = "" if row["ok"] else "  <-- outside target"
            lines.append(compare_table.row(r["layout"], row, "simulated", flag))
    return "\n".join(lines)
