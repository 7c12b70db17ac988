"""--objective dpo (docs/dpo.md): against TRL's DPOTrainer, and what the reference model costs in memory.

    PYTHONPATH=src:tests python benchmarks/dpo.py trl       # meshlm train vs DPOTrainer.train(), two steps
    PYTHONPATH=src:tests python benchmarks/dpo.py variants  # each loss on one batch vs DPOTrainer.compute_loss
    PYTHONPATH=src:tests python benchmarks/dpo.py memory    # the reference's bytes: LoRA, a frozen copy, precomputed

`trl` builds the model, tokenizer and pairs tests/test_dpo.py uses and prints both trainers' first two steps and
their relative difference. `memory` trains a ~50M Llama (fp32, built-in pairs) for 2 steps per row on one process
and zero3 on 4, and prints rank 0's model state, reference bytes and peak resident memory (ru_maxrss).
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

from harness import metrics, run_job, train_rows

KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def trl() -> None:
    from test_dpo import _trl_trainer, make_peer, matched_to_trl

    with tempfile.TemporaryDirectory() as tmp:
        made = make_peer(Path(tmp))
        run_job(
            [
                sys.executable,
                "-m",
                "meshlm",
                "train",
                *map(str, matched_to_trl(made[0])),
                "--output-dir",
                f"{tmp}/meshlm",
            ]
        )
        mine = metrics(Path(tmp) / "meshlm")
        trainer = _trl_trainer(made, "sigmoid", 0.1, 0.0, max_steps=2, learning_rate=1e-3, lr_scheduler_type="constant")
        trainer.args.logging_steps = 1
        trainer.train()
        theirs = [r for r in trainer.state.log_history if "grad_norm" in r]
    print("| step | quantity | meshlm | TRL DPOTrainer | relative difference |")
    print("|---:|---|---:|---:|---:|")
    for step, (a, b) in enumerate(zip(mine, theirs), 1):
        for k in KEYS:
            rel = abs(a[k] - b[k]) / abs(b[k]) if b[k] else (0.0 if a[k] == b[k] else math.inf)
            print(f"| {step} | {k} | {a[k]:.9g} | {b[k]:.9g} | {rel:.2e} |")


VARIANTS = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("sigmoid_norm", 0.1, 0.0)]


def variants() -> None:
    from test_dpo import make_peer, one_batch_against_trl

    with tempfile.TemporaryDirectory() as tmp:
        made = make_peer(Path(tmp))
        print("| loss, beta, label smoothing | quantity | meshlm | TRL | relative difference |")
        print("|---|---|---:|---:|---:|")
        for v in VARIANTS:
            mine, theirs = one_batch_against_trl(made, *v)
            for k, a, b in zip(("loss", "rewards/chosen", "rewards/rejected", "grad_norm"), mine, theirs):
                print(f"| {', '.join(map(str, v))} | {k} | {a:.9g} | {b:.9g} | {abs(a - b) / abs(b):.2e} |")


MODEL = ["--arch.hidden-size", "512", "--arch.layers", "8", "--arch.heads", "8", "--arch.kv-heads", "8",
         "--arch.intermediate-size", "1408", "--seq-length", "128", "--builtin-samples", "400"]  # fmt: skip
ROWS = {
    "sft, LoRA r=8": (1, ["--lora.r", "8"]),
    "dpo, LoRA r=8": (1, ["--objective", "dpo", "--lora.r", "8"]),
    "sft, full": (1, []),
    "dpo, full (frozen copy)": (1, ["--objective", "dpo"]),
    "dpo, full, precomputed": (1, ["--objective", "dpo", "--dpo.precompute-reference", "true"]),
    "zero3 x4 sft, full": (4, ["--strategy", "zero3"]),
    "zero3 x4 dpo, full (frozen copy)": (4, ["--strategy", "zero3", "--objective", "dpo"]),
    "zero3 x4 dpo, LoRA r=8": (4, ["--strategy", "zero3", "--objective", "dpo", "--lora.r", "8"]),
}


def memory() -> None:
    mib = 2**20
    print("| run | ranks | model state / rank (MiB) | reference_bytes / rank (MiB) | peak RSS rank 0 (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, (nproc, args) in ROWS.items():
        row = train_rows(nproc, 2, 2, 8 // nproc, *MODEL, *args)[-1]
        print(
            f"| {name} | {nproc} | {row['model_state_bytes'] / mib:.1f} | {row.get('reference_bytes', 0) / mib:.1f} "
            f"| {row['mem_peak_bytes'] / mib:.0f} |"
        )


if __name__ == "__main__":
    {"trl": trl, "variants": variants, "memory": memory}[sys.argv[1]]()
