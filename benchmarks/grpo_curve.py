"""docs/grpo.md's recipes, measured: the reward curve of GRPO from the supervised run's model, and the exact-match
accuracy on held-out built-in prompts before and after.

    python benchmarks/grpo_curve.py held-out OUT.jsonl [--tasks copy,reverse] [--per-task 40]
    python benchmarks/grpo_curve.py score OUT.jsonl GENERATED.jsonl   # meshlm generate --greedy's output
    python benchmarks/grpo_curve.py curve RUN_DIR [--window 20]       # a GRPO run with --log-every 1
    PYTHONPATH=src python benchmarks/grpo_curve.py from-make-train WORK_DIR

`held-out` writes built-in records that the training corpus (--builtin-samples 4000, --seed 1234: the defaults)
does not hold, drawn with another seed, the same number of each task; `score` prints the share whose greedy
completion, stripped, is the exact answer, per task; `curve` the mean reward of the first and the last `window`
steps of metrics.jsonl and their difference; `from-make-train` runs the first recipe whole: make train's job, its
export, GRPO on the majority prompts (MAKE_TRAIN_GRPO), the held-out accuracy before and after, greedy and sampled
(`benchmarks/run.py grpo grpo-reward-rise-make-train` records it).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

from harness import run_job

from meshlm.config import BUILTIN_TASKS
from meshlm.data.builtin import corpus, task_of

# docs/grpo.md's first recipe: GRPO from make train's model on the one built-in task that model half-answers
MAKE_TRAIN_GRPO = (
    *("--nproc", "2", "--strategy", "zero3", "--objective", "grpo", "--pretrained", "true"),
    *("--grpo.tasks", "majority", "--grpo.reward", "exact_match", "--grpo.group-size", "8"),
    *("--micro-batch-size", "16", "--grpo.max-new-tokens", "8", "--lr", "3e-4", "--max-steps", "300"),
    *("--log-every", "1", "--progress", "false"),
)
TRAINING = (4000, 1234)  # meshlm train's --builtin-samples and --seed defaults: the records the model trained on
HELD_OUT_SEED = 7


def held_out(out: Path, tasks: str, per_task: int) -> None:
    seen = {(r["instruction"], r["input"]) for r in corpus(*TRAINING)}
    wanted = [t.strip() for t in tasks.split(",") if t.strip()]
    by_task = collections.defaultdict(list)
    for rec in corpus(20 * per_task * len(BUILTIN_TASKS), HELD_OUT_SEED):
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


def _meshlm(*args) -> float:
    """Run one meshlm command to its end, in this environment (the threads as a user's run has them); its wall s."""
    return run_job([sys.executable, "-m", "meshlm", *map(str, args)], env=dict(os.environ))["wall_s"]


def _accuracy(model: Path, prompts: Path, work: Path) -> dict:
    """Exact-match share of the held-out prompts, greedy and sampled at temperature 1."""
    got = {}
    for name, how in (("greedy", ["--greedy"]), ("sampled", ["--temperature", "1", "--seed", "0"])):
        out = work / f"{model.name}-{name}.jsonl"
        args = ["--model-name", model, "--prompts", prompts, "--out", out, "--overwrite", "--max-new-tokens", "8"]
        _meshlm("generate", *args, *how, "--nproc", "1")
        got[name] = round(score(prompts, out)["all"], 4)
    return got


def from_make_train(work: Path) -> dict:
    """make train's job, its export, GRPO from it; the curve and the held-out accuracy before and after."""
    sft, grpo, prompts = work / "sft", work / "grpo", work / "held-out.jsonl"
    sft_wall = _meshlm("train", "--nproc", "2", "--progress", "false", "--output-dir", sft)
    _meshlm("export", "--checkpoint", sft, "--out", work / "sft-hf")
    held_out(prompts, "majority", 100)
    before = _accuracy(work / "sft-hf", prompts, work)
    wall = _meshlm("train", *MAKE_TRAIN_GRPO, "--model-name", work / "sft-hf", "--output-dir", grpo)
    _meshlm("export", "--checkpoint", grpo, "--out", work / "grpo-hf")
    after = _accuracy(work / "grpo-hf", prompts, work)
    sft_loss = [json.loads(line) for line in (sft / "metrics.jsonl").open()][-1]["loss"]
    rewards = [r["reward"] for r in map(json.loads, (grpo / "metrics.jsonl").open()) if "reward" in r]
    by_20 = [round(sum(rewards[i : i + 20]) / len(rewards[i : i + 20]), 3) for i in range(0, len(rewards), 20)]
    got = curve(grpo, 20) | {"grpo_wall_s": round(wall, 1), "sft_wall_s": round(sft_wall, 1), "sft_loss": sft_loss}
    got["reward_by_20_steps"] = by_20
    return got | {"held_out_before": before, "held_out_after": after, "held_out_prompts": 100}


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
    m = sub.add_parser("from-make-train")
    m.add_argument("work", type=Path)
    a = ap.parse_args()
    if a.what == "held-out":
        held_out(a.out, a.tasks, a.per_task)
    elif a.what == "from-make-train":
        a.work.mkdir(parents=True, exist_ok=True)
        print(json.dumps(from_make_train(a.work)))
    else:
        got = score(a.prompts, a.generated) if a.what == "score" else curve(a.run, a.window)
        print(json.dumps({k: round(v, 4) for k, v in got.items()}))


if __name__ == "__main__":
    main()
