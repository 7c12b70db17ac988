"""Run the cases of a suite through the harness and append one results line each.

    python benchmarks/run.py SUITE [CASE ...] [--conditions quiet|loaded]
    python benchmarks/run.py --list          # the suites and their cases

A case without a `measure` is run by the script its command names; run.py leaves it out. Then
`python benchmarks/render.py` puts the new line into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys

import harness
import suites


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", nargs="?")
    ap.add_argument("cases", nargs="*", help="case ids (default: every case of the suite the harness can run)")
    ap.add_argument("--conditions", choices=["quiet", "loaded"], help="say so (default: from the load average)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    if a.list or not a.suite:
        for s in suites.SUITES:
            print(f"{s.name}: " + ", ".join(c.id + ("" if c.measure else " (own script)") for c in s.cases))
        return 0
    suite = suites.by_name(a.suite)
    for case in [c for c in suite.cases if c.measure and (not a.cases or c.id in a.cases)]:
        line = harness.measure(case, a.conditions)
        path = harness.append(suite.name, line)
        print(f"{case.id}: {line['value']:.4g} {case.unit} ({line['conditions']}) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
