"""Each rank's last step, for naming a rank that stopped answering.

A rank frozen by SIGSTOP (or a hung driver) leaves no stack dump: it cannot run faulthandler's SIGTERM
handler, so the launcher kills it with SIGKILL in the end, and its log ends wherever it last wrote. The
step it was in is the clue the console can give. Each rank overwrites logs/rank-N.step in place with the
step it enters: one pwrite of a few bytes per step, no new file and no flush to wait for.
"""

from __future__ import annotations

import os
from pathlib import Path

WIDTH = 12  # digits: a shorter number is padded with spaces, so an overwrite never leaves a longer one's tail


def path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank}.step"


class Heartbeat:
    def __init__(self, log_dir: Path, rank: int):
        self.fd = os.open(path(log_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def beat(self, step: int) -> None:
        os.pwrite(self.fd, f"{step:>{WIDTH}}\n".encode(), 0)

    def close(self) -> None:
        os.close(self.fd)


def last_step(log_dir: Path, rank: int) -> int | None:
    """The step rank `rank` last entered, or None when it wrote none (or the file is not a number)."""
    try:
        text = path(log_dir, rank).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
