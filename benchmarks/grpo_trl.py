"""meshlm train --objective grpo against TRL's GRPOTrainer (transformers' generate, no vLLM): step throughput.

    PYTHONPATH=src python benchmarks/grpo_trl.py [--nproc 2] [--steps 8] [--warmup 2] [--repeats 3] [--record]

The same job on both sides: a random Llama (transformers' LlamaConfig: hidden 256, 4 blocks, 4 / 2 heads, MLP 704,
the byte tokenizer, fp32) saved to a temp dir and loaded by both (`--pretrained true`), the same 32 arithmetic
prompts, a group of 4 completions per prompt, at most 32 new tokens at temperature 1, 8 completions per rank per
step (2 prompts), one update per generated batch, beta 0, TRL's default loss (dapo), AdamW at a constant 1e-5, the
same reward function (the first completion token's parity). meshlm runs ddp (TRL's layout under Accelerate: DDP
over gloo on CPU ranks), its rows padded to --seq-length 64 (longest prompt + 32). Each side's steady step time
after the warm-up steps; the sides take turns, best of --repeats each. Printed: steps/s, the generation share of
a step, and meshlm / TRL; --record appends the results line of the grpo-vs-trl-throughput claim.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness import ENV, HERE, RESULTS, _version, commit, machine, metrics, run_job, torchrun

REWARDS = """
def parity(prompts, completions, completion_ids, **kw):
    return [float(len(ids) > 0 and ids[0] % 2 == 0) for ids in completion_ids]
"""
GROUP, MAX_NEW, MICRO, SEQ = 4, 32, 8, 64


def make_job(root: Path) -> Path:
    """The model (with the byte tokenizer), prompts.jsonl and the reward module under `root`."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshlm.data.builtin import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=704, max_position_embeddings=256, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = random.Random(0)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(32)]
    rows = [{"prompt": f"Add the two numbers.\n{a} + {b} =", "answer": str(a + b)} for a, b in pairs]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "grpo_bench_rewards.py").write_text(REWARDS)
    return root


def env(job: Path) -> dict:
    return {**ENV, "PYTHONPATH": ":".join([str(job), ENV.get("PYTHONPATH", "")])}


def meshlm(job: Path, nproc: int, steps: int, warmup: int) -> dict:
    """meshlm's steady step time after `warmup` steps (metrics rows of every step)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "meshlm", "train", "--model-name", str(job / "model"), "--pretrained", "true"]
        cmd += ["--objective", "grpo", "--dataset-name", str(job / "prompts.jsonl"), "--seq-length", str(SEQ)]
        cmd += ["--grpo.group-size", str(GROUP), "--grpo.max-new-tokens", str(MAX_NEW), "--grpo.temperature", "1"]
        cmd += ["--grpo.reward", "grpo_bench_rewards:parity", "--micro-batch-size", str(MICRO), "--lr", "1e-5"]
        cmd += ["--min-lr-ratio", "1", "--warmup-steps", "0", "--max-steps", str(steps), "--log-every", "1"]
        cmd += ["--progress", "false", "--save-final", "false", "--output-dir", out, "--seed", "0"]
        if nproc > 1:
            cmd += ["--nproc", str(nproc), "--omp-threads", "1", "--strategy", "ddp"]
        job_run = run_job(cmd, env(job))
        rows = metrics(out)[warmup:]
    steady = sum(r["step_time_s"] for r in rows)
    return {
        "steps_per_s": len(rows) / steady,
        "step_s": steady / len(rows),
        "generation_share": sum(r["generation_s"] for r in rows) / steady,
        "mean_completion_length": sum(r["completions/mean_length"] for r in rows) / len(rows),
        "peak_rss_bytes": max(job_run["peak_rss_bytes_per_rank"]),
        "command": " ".join(["meshlm", *cmd[3:]]).replace(out, "OUT").replace(str(job), "JOB"),
    }


def trl(job: Path, nproc: int, steps: int, warmup: int) -> dict:
    cmd = [*torchrun(nproc), str(HERE / "grpo_trl_job.py"), "--job", str(job), "--steps", str(steps)]
    cmd += ["--warmup", str(warmup), "--micro-batch", str(MICRO), "--group-size", str(GROUP)]
    cmd += ["--max-new-tokens", str(MAX_NEW)]
    out = run_job(cmd, env(job))
    return json.loads(out["stdout"].strip().splitlines()[-1])


def _note(nproc: int, sides: dict) -> str:
    m, t = sides["meshlm"], sides["trl"]
    return (
        f"{nproc} CPU ranks, ddp (TRL {_version('trl')}: Accelerate's DDP over gloo), best of 3 each, the sides "
        f"taking turns: meshlm {m['steps_per_s']:.3f} steps/s ({m['generation_share']:.0%} generating), TRL "
        f"{t['steps_per_s']:.3f} ({t['generation_share']:.0%}); completions {m['mean_completion_length']:.1f} and "
        f"{t['mean_completion_length']:.1f} tokens on average"
    )


def record(nproc: int, sides: dict, ratio: float, steps: int, warmup: int) -> None:
    """The grpo-vs-trl-throughput results line (benchmarks/results/grpo.jsonl)."""
    import datetime
    import os

    line = {
        "id": "grpo-vs-trl-throughput",
        "value": round(ratio, 4),
        "unit": "x",
        "target": [">=", 1.0],
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(),
        "load": [round(x, 2) for x in sides.pop("load")],
        "conditions": "loaded" if max(sides["load_seen"]) >= 0.5 * (os.cpu_count() or 1) else "quiet",
        "command": f"PYTHONPATH=src python benchmarks/grpo_trl.py --nproc {nproc} --steps {steps} --warmup {warmup}"
        " --record",
        "source": "benchmarks/grpo_trl.py",
        "note": _note(nproc, sides),
        "measurements": {k: v for k, v in sides.items() if k != "load_seen"} | {"trl_version": _version("trl")},
    }
    with (RESULTS / "grpo.jsonl").open("a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="append the results line to results/grpo.jsonl")
    a = ap.parse_args(argv)
    if a.record and (a.nproc, a.repeats) != (2, 3):
        ap.error("--record is the claim's job: --nproc 2 --repeats 3")
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        job = make_job(Path(tmp))
        runs = {"meshlm": [], "trl": []}
        for _ in range(a.repeats):  # the sides take turns: a slow minute hurts both alike
            for name, side in (("meshlm", meshlm), ("trl", trl)):
                runs[name].append(side(job, a.nproc, a.steps, a.warmup))
                load.append(os.getloadavg()[0])
                print(name, json.dumps({k: v for k, v in runs[name][-1].items() if k != "command"}), flush=True)
    best = {k: max(v, key=lambda r: r["steps_per_s"]) for k, v in runs.items()}
    ratio = best["meshlm"]["steps_per_s"] / best["trl"]["steps_per_s"]
    print(f"meshlm / TRL steps/s on {a.nproc} ranks: {ratio:.3f}")
    if a.record:
        sides = {
            "meshlm": best["meshlm"],
            "trl": best["trl"],
            "all_steps_per_s": {k: [round(r["steps_per_s"], 4) for r in v] for k, v in runs.items()},
            "load": [load[0], load[-1]],
            "load_seen": load,
        }
        record(a.nproc, sides, ratio, a.steps, a.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
