"""The table `plan --validate` prints, for the plan's predictions and for the simulation's alike: one row per layout
and quantity, a value beside the measured one, their ratio and the target it must fall within."""

from __future__ import annotations


def head(title: str, value: str) -> list[str]:
    """The title and the column heads, `value` naming the column compared with the measured one."""
    columns = f"{'layout':<22} {'quantity':<28} {value:>12} {'measured':>12} {'ratio':>7} {'target':>7}"
    return [title, columns, "-" * len(columns)]


def row(layout: str, r: dict, value: str, flag: str) -> str:
    """One quantity of one layout: r[value] against r["measured"]."""
    return (
        f"{layout:<22} {r['quantity']:<28} {r[value]:>12,} {r['measured']:>12,} "
        f"{r['ratio']:>7.3f} {'±' + format(r['target'], '.0%'):>7}{flag}"
    )
