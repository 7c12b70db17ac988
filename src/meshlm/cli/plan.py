"""`meshlm plan`: its options and its work are the planner's (meshlm.plan.cli), imported only when it runs."""

from __future__ import annotations

DESCRIPTION = (
    "Memory, communication and time of every layout of a model on a cluster; "
    "a recommendation and the command that runs it. --validate checks the model "
    "against real runs on this machine."
)


def add_options(p) -> None:
    from meshlm.plan.cli import add_options as add_plan_options

    add_plan_options(p)


def run(args, argv) -> int:
    from meshlm.plan.cli import run as run_plan

    return run_plan(args)
