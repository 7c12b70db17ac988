"""The planner's simulation reaches training through parallelize's one seam (parallel/apply.py Standins), whose
defaults are training's own, and replaces no other module's attribute outside compat_transformers.py."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel as DDP

from meshlm.models.materialize import materialize
from meshlm.parallel.apply import TRAINING, Standins, parallelize

QUARANTINE = ("compat.py", "compat_transformers.py")
SRC = Path(__file__).resolve().parents[2] / "src" / "meshlm"


def test_training_runs_the_real_fill_and_ddp_by_default():
    assert TRAINING == Standins(materialize, DDP)
    assert inspect.signature(parallelize).parameters["standins"].default is TRAINING
    assert not {"fill", "ddp"} & set(inspect.signature(parallelize).parameters)


def test_the_simulation_replaces_fill_and_ddp_through_the_seam():
    from meshlm.plan.simulate_standins import SIMULATED, SimulatedDDP, shapes_only

    assert SIMULATED == Standins(fill=shapes_only, ddp=SimulatedDDP)


def test_only_the_compat_modules_assign_another_modules_attribute():
    """An assignment to `<transformers or torch module>.<name>` (spelled through those names) happens only inside
    compat.py and compat_transformers.py, where each is put back on exit."""
    assigned = re.compile(r"^\s*(moe|transformers|torch)(\.\w+)+\s*=(?!=)", re.M)
    found = [p.name for p in SRC.rglob("*.py") if assigned.search(p.read_text()) and p.name not in QUARANTINE]
    assert found == []


def test_storage_resizes_are_observed_and_the_method_put_back():
    """LiveBytes' view of FSDP2 freeing a gathered parameter (a storage resized to 0), through compat.py."""
    import torch

    from meshlm.compat import storage_resizes_observed

    real, seen = torch.UntypedStorage.resize_, []
    st = torch.empty(4).untyped_storage()
    with storage_resizes_observed(lambda s, before=None: lambda b=s.nbytes(): seen.append((b, s.nbytes()))):
        st.resize_(0)
    assert seen == [(16, 0)]
    assert torch.UntypedStorage.resize_ is real
