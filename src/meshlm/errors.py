"""The one exception type that means "the user asked for something wrong", and the one that means "stopped".

MeshlmError is shown as a single `meshlm: error: ...` line with exit status 2; Interrupted (SIGINT/SIGTERM
between two steps) as a single `meshlm: interrupted ...` line with 128 + the signal; anything else is a bug
or a failure and keeps its traceback.
"""

import os
import signal
import sys
from pathlib import Path

EXIT_USAGE = 2


class MeshlmError(Exception):
    """Bad input: shown as one line, exit status 2."""


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal; str() is the line to show, the exit status is 128 + signum."""

    def __init__(self, line: str, signum: int):
        super().__init__(line)
        self.signum = signum


def interrupted(signum: int, out_dir: Path | None) -> str:
    """The one line of a run stopped by SIGINT/SIGTERM: the signal and the checkpoint a rerun resumes from."""
    name = signal.Signals(signum).name
    if out_dir is None:
        return f"interrupted ({name})"
    latest = out_dir / "checkpoints" / "latest"
    last = latest.read_text().strip() if latest.is_file() else ""
    where = f"last checkpoint {out_dir / 'checkpoints' / last}" if last else "no checkpoint was written"
    return f"interrupted ({name}); {where}"


def exit_status(fn, *args) -> int:
    """fn(*args)'s exit status as `meshlm` gives it: what it returns if an int, else 0; a MeshlmError's one line and
    EXIT_USAGE; a stop on a signal's line and 128 + the signal (Interrupted; Ctrl-C anywhere else)."""
    launched = bool(os.environ.get("MESHLM_LAUNCHED"))
    # Under the launcher every rank's stderr goes to a file and the launcher shows one copy;
    # under plain torchrun only rank 0 speaks, so the console gets one line, not N.
    speaks = launched or os.environ.get("RANK", "0") == "0"
    try:
        status = fn(*args)
        return status if isinstance(status, int) else 0
    except MeshlmError as e:
        if speaks:
            print(f"meshlm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        if speaks and not launched:  # the launcher says it once for all ranks
            print(f"meshlm: {str(e) or 'interrupted (SIGINT)'}", file=sys.stderr)  # Ctrl-C's own has no text
        return 128 + getattr(e, "signum", signal.SIGINT)
