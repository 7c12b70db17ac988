"""docs/grpo.md's recipe, measured: the reward curve of GRPO from the supervised run's model, and the exact-match
accuracy on held-out built-in prompts before and after.

    python benchmarks/grpo_curve.py held-out OUT.jsonl [--tasks copy,reverse] [--per-task 40]
    python benchmarks/grpo_curve.py score OUT.jsonl GENERATED.jsonl   # meshlm generate --greedy's output
    python benchmarks/grpo_curve.py curve RUN_DIR [--window 20]       # a GRPO run with --log-every 1

`held-out` writes built-in records that the training corpus (--builtin-samples 4000, --seed 1234: the defaults)
does not hold, drawn with another seed, the same number of each task; `score` prints the share whose greedy
completion, stripped, is the exact answer, per task; `curve` the mean reward of the first and the last `window`
steps of metrics.jsonl and their difference.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from meshlm.data.builtin import corpus, task_of

TRAINING = (4000, 1234)  # meshlm train's --builtin-samples and --seed defaults: the records the model trained on
HELD_OUT_SEED = 7


def held_out(out: Path, tasks: str, per_task: int) -> None:
    seen = {(r["instruction"], r["input"]) for r in corpus(*TRAINING)}
    wanted = [t.strip() for t in tasks.split(",") if t.strip()]
    by_task = collections.defaultdict(list)
    for rec in corpus(20 * per_task * 6, HELD_OUT_SEED):
        task = task_of(rec)
        if (rec["instruction"], rec["input"]) not in seen and (not wanted or task in wanted):
            by_task[task].append(rec)
    with out.open("w") as f:
        for task in sorted(by_task):
            for rec in by_task[task][:per_task]:
                f.write(json.dumps(rec) + "\n")


def score(prompts: Path, generated: Path) -> dict:
    recs = [json.loads(line) for line in prompts.open()]
    outs = [json.loads(line) for line in generated.open()]
    hits, seen = collections.Counter(), collections.Counter()
    for rec, out in zip(recs, outs, strict=True):
        seen[task_of(rec)] += 1
        hits[task_of(rec)] += out["completion"].strip() == rec["output"]
    result = {t: hits[t] / seen[t] for t in sorted(seen)}
    result["all"] = sum(hits.values()) / sum(seen.values())
    return result


def curve(run: Path, window: int) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = rewards[:window], rewards[-window:]
    a, b = sum(first) / len(first), sum(last) / len(last)
    zero_std = [r["frac_reward_zero_std"] for r in rows if "frac_reward_zero_std" in r]
    return {
        "steps": len(rewards),
        "first": a,
        "last": b,
        "rise": b - a,
        "frac_reward_zero_std_first": sum(zero_std[:window]) / max(1, len(zero_std[:window])),
        "frac_reward_zero_std_last": sum(zero_std[-window:]) / max(1, len(zero_std[-window:])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("held-out")
    h.add_argument("out", type=Path)
    h.add_argument("--tasks", default="")
    h.add_argument("--per-task", type=int, default=40)
    s = sub.add_parser("score")
    s.add_argument("prompts", type=Path)
    s.add_argument("generated", type=Path)
    c = sub.add_parser("curve")
    c.add_argument("run", type=Path)
    c.add_argument("--window", type=int, default=20)
    a = ap.parse_args()
    if a.what == "held-out":
        held_out(a.out, a.tasks, a.per_task)
    else:
        got = score(a.prompts, a.generated) if a.what == "score" else curve(a.run, a.window)
        print(json.dumps({k: round(v, 4) for k, v in got.items()}))


if __name__ == "__main__":
    main()
