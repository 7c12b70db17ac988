"""A testing aid, off unless its variable is set: what a rank started by meshlm's launcher imported and ran.

  MESHLM_RANK_TRACE=DIR    each rank writes DIR/rank-N.json when its command returns: "modules", the meshlm
                           modules in its sys.modules (the fork server's imports included: the rank has them),
                           and "calls", how many times each meshlm function ran in its main thread (counted by
                           a profile hook, so attributes stay as they are)

Tests read it to hold the training path to what trains and each check to one run per process.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

VARIABLE = "MESHLM_RANK_TRACE"
_PACKAGE = str(Path(__file__).resolve().parent)


def start() -> Counter | None:
    """Count the main thread's calls of meshlm functions from here on, when the variable is set."""
    if not os.environ.get(VARIABLE):
        return None
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            calls[f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}"] += 1

    sys.setprofile(profile)
    return calls


def write(calls: Counter | None) -> None:
    """DIR/rank-N.json: the modules and the counted calls (nothing when tracing is off)."""
    if calls is None:
        return
    sys.setprofile(None)
    modules = sorted(m for m in sys.modules if m == "meshlm" or m.startswith("meshlm."))
    record = {"modules": modules, "calls": dict(sorted(calls.items()))}
    path = Path(os.environ[VARIABLE]) / f"rank-{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
