"""The one exception type that means "the user asked for something wrong", and the one that means "stopped".

MeshlmError is shown as a single `meshlm: error: ...` line with exit status 2; Interrupted (SIGINT/SIGTERM
between two steps) as a single `meshlm: interrupted ...` line with 128 + the signal; anything else is a bug
or a failure and keeps its traceback.
"""

import signal
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
