"""What a rank forked by meshlm's launcher does first (cli.rank_main): kept apart from launch.py, so a rank
imports none of the launcher (torchelastic's agent, the rendezvous, the failure report)."""

from __future__ import annotations

import os
import select
import signal
import threading

LAUNCHER_PID = "MESHLM_LAUNCHER_PID"  # set by launch._for_the_ranks: the process every rank dies with


def become_rank() -> None:
    """The first thing a rank forked by launch() does (cli.rank_main): a session of its own, as torchrun's rank
    processes have, so a terminal's Ctrl-C reaches the launcher only (which passes it on once); and death with
    the launcher."""
    die_with_launcher(int(os.environ[LAUNCHER_PID]))
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked in the fork server it came from


def die_with_launcher(launcher: int) -> None:
    """In a rank started by meshlm's launcher: be killed when the launcher dies, however it dies (SIGKILL by
    the OOM killer, a closed terminal), so no rank goes on training into a run directory nobody holds.

    Each rank runs in a session of its own (become_rank), so nothing else reaches it, and its parent is the
    launcher's fork server, which lives as long as any rank holds its pipe: a daemon thread waits on the
    launcher's pidfd instead (Linux 5.3 and later; elsewhere a rank outlives a killed launcher)."""
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:  # the launcher died before the watch began
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return

    def watch():
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="meshlm-launcher-watch", daemon=True).start()
