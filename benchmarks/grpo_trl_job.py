"""TRL's GRPOTrainer (transformers' generate, no vLLM) on benchmarks/grpo_trl.py's job, one process per rank.

    torchrun --nproc-per-node 2 benchmarks/grpo_trl_job.py --job DIR --steps N --warmup W --micro-batch B ...

Launched by grpo_trl.py: Accelerate sees WORLD_SIZE > 1 and no CUDA and runs DDP over gloo (MULTI_CPU). Prints
one JSON line last: steady steps/s after `--warmup` steps (optimizer steps, each one generation and one update),
the generation share of that time, the completion tokens generated and rank 0's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True, help="grpo_trl.py's job directory: model/, prompts.jsonl, rewards module")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8, help="completions per rank per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    return ap.parse_args(argv)


def step_clock():
    """A TrainerCallback recording when each optimizer step ends, and the generate calls' seconds per step."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    return Clock()


def timed_generate(model, spent: list[float]) -> None:
    """model.generate wrapped to add its seconds to `spent` (TRL calls it through the unwrapped model)."""
    inner = model.generate

    def generate(*args, **kwargs):
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        spent.append(time.perf_counter() - t)
        return out

    model.generate = generate


def trainer(a: argparse.Namespace, out: str):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, a.job)
    from grpo_bench_rewards import parity

    records = [json.loads(x) for x in open(f"{a.job}/prompts.jsonl")]
    model = AutoModelForCausalLM.from_pretrained(f"{a.job}/model", dtype=torch.float32)
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=a.micro_batch, num_generations=a.group_size,
        max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, max_steps=a.steps, logging_steps=1, report_to=[],
        use_cpu=True, bf16=False, save_strategy="no", seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    return GRPOTrainer(
        model=model,
        reward_funcs=[parity],
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(f"{a.job}/model"),
    )


def main(argv: list[str] | None = None) -> int:
    import tempfile

    a = parse(argv)
    with tempfile.TemporaryDirectory() as out:
        t = trainer(a, out)
        clock, spent = step_clock(), []
        t.add_callback(clock)
        timed_generate(t.model, spent)
        t.train()
    ends = clock.ends[1:]  # one per optimizer step
    steady = ends[-1] - ends[a.warmup - 1]
    gen = sum(spent[a.warmup :])
    completions = [r["completions/mean_length"] for r in t.state.log_history if "completions/mean_length" in r]
    if t.accelerator.is_main_process:
        print(
            json.dumps(
                {
                    "steps_per_s": (a.steps - a.warmup) / steady,
                    "step_s": steady / (a.steps - a.warmup),
                    "generation_share": gen / steady,
                    "mean_completion_length": sum(completions[a.warmup :]) / max(1, len(completions[a.warmup :])),
                    "distributed_type": str(t.accelerator.distributed_type),
                    "world": t.accelerator.num_processes,
                    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
