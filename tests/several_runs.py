"""Several `meshlm train` runs in one launch of N ranks (conftest.run_several starts it under torchrun).

Starting N Python processes that import torch and transformers is most of a small multi-rank test's time on a
2-core machine, so each rank here runs the real Trainer (train/trainer.py, as `meshlm train` does) for every run
of a JSON list in turn, in one process group: the layouts each run asks for are built on it one after another.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/several_runs.py RUNS.json

RUNS.json: a list of `meshlm train` command lines (config keys and values only, each with its --output-dir).
"""

from __future__ import annotations

import json
import sys

from meshlm import runtime
from meshlm.config import load, parse_args
from meshlm.train.trainer import Trainer


def main(spec: str) -> None:
    runs = json.loads(open(spec).read())
    rt = runtime.init("gloo", 300.0, want_cuda=False)
    try:
        for args in runs:
            runtime.setup_logging(rt)
            Trainer(load(None, parse_args(args)), rt).run()
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
