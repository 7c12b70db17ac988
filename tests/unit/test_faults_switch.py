"""train/faults.py is imported by a rank only when one of its variables is set (runtime.FAULT_VARIABLES): every
variable it reads must be on that list, or setting it would do nothing."""

from __future__ import annotations

import re
from pathlib import Path

from meshlm import runtime

FAULTS = Path(runtime.__file__).parent / "train" / "faults.py"
QUALIFIERS = {"MESHLM_FAIL_RANK", "MESHLM_STALL_RANK"}  # which rank misbehaves: read only beside their fault


def test_every_fault_variable_switches_the_module_on():
    read = set(re.findall(r'os\.environ\.get\("(MESHLM_[A-Z_]+)"', FAULTS.read_text()))
    read |= set(re.findall(r'_at\("(MESHLM_[A-Z_]+)"', FAULTS.read_text()))
    assert read - QUALIFIERS == set(runtime.FAULT_VARIABLES)


def test_no_variable_no_module(monkeypatch):
    for name in runtime.FAULT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert runtime.injected_faults() is None
    monkeypatch.setenv("MESHLM_PAUSE_IN_SAVE", "3")
    assert runtime.injected_faults().__name__ == "meshlm.train.faults"
