"""`meshlm env`: versions, devices and backends for a bug report (env.py does the work)."""

from __future__ import annotations

DESCRIPTION = (
    "Print the versions of meshlm and the packages it uses, the devices and process group "
    "backends this machine has, and the torchrun it would use: paste it into a bug report."
)


def add_options(p) -> None:
    """No options."""


def run(args, argv) -> int:
    from meshlm.env import report

    print(report())
    return 0
