"""Expert parallel on 4 CPU ranks: expert memory per rank, peak RSS and tokens/s of a ~107M-parameter
mixture of experts under ddp, zero3 and ep 4, against the planner.

A Qwen3-MoE from transformers' config class: hidden 512, 8 blocks, 8 heads / 4 kv heads, 8 experts of width
1024 per block (top 2), byte vocabulary, untied; saved as safetensors, loaded with --pretrained; fp32, AdamW,
micro-batch 1 x 128 tokens per rank. Each run is `meshlm train --nproc 4` with one OpenMP thread per rank.

- expert state: the largest rank's expert weights + gradients + AdamW states (the metrics row's
  expert_state_bytes, measured after backward and the step), against ddp's and against the planner's
  16 bytes x expert parameters / ep.
- peak RSS: the largest process's ru_maxrss less the same job on a tiny model (torch and transformers
  themselves), against the planner's peak per GPU for the layout (benchmarks/peak_memory.py's method).
- tokens/s: zero3 4 (every rank gathers every expert of each block) against ep 4, best of 3 with the two taking
  turns, steps after the first logged interval; the all-to-all share is the row's all_to_all_s (host time in
  the dispatch's all_to_all_single calls of rank 0, per step) over its step time.

    python benchmarks/moe.py                      # both tables (about 15 minutes on 2 shared cores)
    python benchmarks/moe.py --skip-throughput    # the memory table only
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from harness import metrics
from peak_memory import peak_rss, planned
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from meshlm.data.builtin import byte_tokenizer

TRAIN = ["--pretrained", "--micro-batch-size", "1", "--seq-length", "128", "--builtin-samples", "400",
         "--progress", "false", "--save-final", "false", "--nproc", "4", "--omp-threads", "1"]  # fmt: skip
LAYOUTS = {  # name -> (meshlm train arguments, the planner's layout name)
    "ddp 4": (["--strategy", "ddp"], "ddp"),
    "zero3 4": (["--strategy", "zero3"], "zero3"),
    "ep 4": (["--strategy", "zero3", "--parallel.ep", "4"], "zero3 ep4"),
}


def save_model(path: Path, hidden: int, layers: int, experts: int, expert_mlp: int) -> dict:
    """A random Qwen3-MoE with the byte tokenizer; returns its parameter counts."""
    vocab = (len(byte_tokenizer()) + 63) // 64 * 64
    heads = max(hidden // 64, 4)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads // 2, head_dim=hidden // heads, intermediate_size=expert_mlp,
        moe_intermediate_size=expert_mlp, num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    experts_n = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"params": sum(p.numel() for p in model.parameters()), "experts": experts_n}


def run(model: Path, out: Path, args: list[str], steps: int, log_every: int) -> tuple[int, list[dict]]:
    """Peak RSS of the largest process and the metrics rows of one `meshlm train` job."""
    every = ["--max-steps", str(steps), "--log-every", str(log_every), "--output-dir", str(out)]
    rss = peak_rss(["train", "--model-name", str(model), *TRAIN, *every, *args])
    rows = metrics(out)
    return rss, rows


def memory_table(root: Path, counts: dict) -> None:
    mib, measured = 2**20, {}
    for name, (args, plan_layout) in LAYOUTS.items():
        fixed, _ = run(root / "tiny", root / f"t-{name}", args, 2, 1)
        peak, rows = run(root / "big", root / f"b-{name}", args, 2, 1)
        plan = planned(root / "big", plan_layout, 4)
        measured[name] = (rows[-1]["expert_state_bytes"], peak - fixed, plan)
    ddp_experts = measured["ddp 4"][0]
    print(f"model: {counts['params'] / 1e6:,.1f}M parameters, {counts['experts'] / 1e6:,.1f}M in experts; 4 ranks")
    print(
        f"{'layout':<9} {'expert state MiB':>17} {'of ddp':>7} {'plan MiB':>9} {'plan/meas':>10} "
        f"{'peak RSS above fixed MiB':>25} {'plan MiB':>9} {'plan/meas':>10}"
    )
    for name, (experts, rss, plan) in measured.items():
        ep = 4 if "ep" in name else 1
        shards = 1 if name.startswith("ddp") else 4  # zero3 shards every expert's weights over the 4 ranks too
        plan_experts = 16 * counts["experts"] // max(ep, shards)
        print(
            f"{name:<9} {experts / mib:>17,.1f} {experts / ddp_experts:>7.2f} {plan_experts / mib:>9,.1f} "
            f"{plan_experts / experts:>10.2f} {rss / mib:>25,.0f} {plan / mib:>9,.0f} {plan / rss:>10.2f}"
        )


def throughput_table(root: Path, rounds: int, steps: int) -> None:
    results = {name: [] for name in ("zero3 4", "ep 4")}
    for i in range(rounds):
        for name in results if i % 2 == 0 else reversed(results):  # the two take turns going first
            _, rows = run(root / "big", root / f"s-{name}-{i}", LAYOUTS[name][0], steps, steps // 3)
            timed = rows[1:]
            tps = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / sum(r["step_time_s"] for r in timed)
            a2a = sum(r.get("all_to_all_s", 0.0) for r in timed) / sum(r["step_time_s"] for r in timed)
            results[name].append((tps, a2a))
    print(f"{'layout':<9} {'tokens/s (best of ' + str(rounds) + ')':>22} {'all runs':>26} {'all-to-all share':>17}")
    for name, runs in results.items():
        best = max(runs)
        print(f"{name:<9} {best[0]:>22,.0f} {' / '.join(f'{t:,.0f}' for t, _ in runs):>26} {best[1]:>17.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9, help="per throughput run; the first third is warm-up")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        counts = save_model(root / "big", 512, 8, 8, 1024)
        save_model(root / "tiny", 64, 2, 8, 32)
        if not args.skip_memory:
            memory_table(root, counts)
        if not args.skip_throughput:
            throughput_table(root, args.rounds, args.steps)


if __name__ == "__main__":
    main()
