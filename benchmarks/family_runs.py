"""Many meshlm runs in one launch: each case of a list (a model family under a layout) goes through meshlm's
real trainer or generator in the ranks of one job. A family matrix then pays one process start-up per world
size (about 10 s on 2 cores), not one per run. Used by tests/test_families.py and benchmarks/families.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/family_runs.py CASES.json OUT.json
    python benchmarks/family_runs.py CASES.json OUT.json              (one process: the references)

CASES.json is a list of {"id", "kind": "train" | "generate", "args": [...]}: a train case's args are
`meshlm train` options (config keys), a generate case's are GenerateOptions fields. With "logits": token ids, a
train case also records the trained model's logits on them (a layout without a pipeline). OUT.json maps each
id to what rank 0 saw: losses and grad norms per step, logits, generated token ids, or the one-line error.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch


def train_case(case: dict, rt) -> dict:
    from meshlm.config import load, parse_args
    from meshlm.train.trainer import Trainer

    cfg = load(None, parse_args(case["args"]))
    trainer = Trainer(cfg, rt)
    trainer.run()
    result = {}
    if rt.is_main:
        rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
        result = {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows]}
    if case.get("logits"):
        ids = torch.tensor(case["logits"], device=rt.device)
        with torch.no_grad():
            out = trainer.engine.model(input_ids=ids, use_cache=False).logits
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        result["logits"] = out.tolist() if rt.is_main else None
    return result


def generate_case(case: dict, rt) -> dict:
    from meshlm.infer.decode import Sampling
    from meshlm.infer.generate import GenerateOptions, generate
    from meshlm.infer.load import ModelSource

    a = dict(case["args"])
    opts = GenerateOptions(
        prompts=a["prompts"],
        out=a["out"],
        mode=a["mode"],
        model=ModelSource(a["model_name"], a.get("checkpoint", "")),
        max_new_tokens=a["max_new_tokens"],
        batch_size=a.get("batch_size", 8),
        sampling=Sampling(),
        overwrite=True,
    )
    generate(opts, rt)
    if not rt.is_main:
        return {}
    rows = [json.loads(line) for line in Path(opts.out).read_text().splitlines()]
    return {"tokens": [r["token_ids"] for r in rows]}


KINDS = {"train": train_case, "generate": generate_case}


def main(cases_path: str, out_path: str) -> None:
    from meshlm import runtime

    rt = runtime.init("gloo", timeout_s=120.0, want_cuda=False)
    runtime.setup_logging(rt)
    results = {}
    for case in json.loads(Path(cases_path).read_text()):
        try:
            results[case["id"]] = KINDS[case["kind"]](case, rt)
        except Exception as e:  # the row says why; the next case still runs (a symmetric failure: every rank)
            lines = str(e).strip().splitlines() or [""]
            results[case["id"]] = {"error": f"{type(e).__name__}: {lines[0][:300]}"}
            if not rt.is_main:
                continue
            traceback.print_exc(file=sys.stderr)
    if rt.is_main:
        Path(out_path).write_text(json.dumps(results))
    runtime.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
