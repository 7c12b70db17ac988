"""`meshlm report`: plots of a run's metrics.jsonl (report.py does the work)."""

from __future__ import annotations

import argparse

DESCRIPTION = (
    "Turn OUTPUT_DIR/metrics.jsonl into loss.png, tokens_per_s.png and memory.png "
    "in OUTPUT_DIR/plots, with rewards.png for a DPO run and reward.png (reward and completion length) for a "
    "GRPO run (needs matplotlib: pip install 'meshlm[plot]')."
)


def add_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's --output-dir")


def run(args, argv) -> int:
    from pathlib import Path

    from meshlm.report import read_metrics, report, summary

    for line in summary(read_metrics(Path(args.output_dir))):
        print(line)
    for path in report(Path(args.output_dir)):
        print(path)
    return 0
