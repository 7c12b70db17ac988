"""The claims the benchmarks make: each suite a short list of cases, each case a metric with its target and the
command that reproduces it. run.py runs the cases that have a `measure` (through harness.py); the others are run
by the script their command names. Every measurement is a line of benchmarks/results/SUITE.jsonl; render.py makes
BENCHMARKS.md of them."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import harness


@dataclass(frozen=True)
class Case:
    id: str  # stable: BENCHMARKS.md's anchor for the claim, which docs link to
    claim: str
    unit: str
    command: str
    target: tuple[str, float] | None = None  # (">=" | "<=" | "within", x); "within": |value - 1| <= x
    measure: Callable[[], dict] | None = None  # -> {"value": ..., other measurements}


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    about: str
    cases: tuple[Case, ...]


def met(target: tuple[str, float] | None, value: float) -> bool | None:
    if target is None:
        return None
    op, x = target
    return value >= x if op == ">=" else value <= x if op == "<=" else abs(value - 1) <= x


def default_job_tokens() -> dict:
    """The default `meshlm train` job in one process: tokens/s after 10 warm-up steps, CPU s per step over the
    whole run (start-up included), peak RSS."""
    job = harness.train_run(1, 30, 10, 8)
    return {
        "value": harness.summary(job["rows"], 10)["tokens_per_s"],
        "cpu_s_per_step_with_startup": job["cpu_s"] / 30,
        "wall_s": job["wall_s"],
        "peak_rss_mib_per_rank": [round(b / 2**20) for b in job["peak_rss_bytes_per_rank"]],
        "job": job["command"],
    }


def default_job_cpu() -> dict:
    """CPU ms per step of the default job in one process: 40 steps less 20 steps, so start-up cancels."""
    short, long = (harness.train_run(1, n, n, 8) for n in (20, 40))
    return {
        "value": (long["cpu_s"] - short["cpu_s"]) / 20 * 1000,
        "cpu_s": [round(short["cpu_s"], 2), round(long["cpu_s"], 2)],
        "peak_rss_mib_per_rank": [round(b / 2**20) for b in long["peak_rss_bytes_per_rank"]],
        "job": long["command"],
    }


DEFAULT_JOB = "python benchmarks/run.py default_job"
VS_ACCELERATE = "cd benchmarks && python vs_accelerate.py --job alpaca --layouts ddp --repeats 3"
PEAK = 'python benchmarks/peak_memory.py --only "{}"'

# The default LoRA job under bf16 mixed precision on a model whose base dominates a rank's memory (~93M
# parameters: fp32 372 MB, 186 MB per zero3 rank): run.py's commands are Python calls, not a shell line.
LORA_BF16 = [
    "--strategy", "zero3", "--lora.r", "8", "--mixed-precision", "bf16", "--arch.hidden-size", "1024",
    "--arch.layers", "8", "--arch.heads", "8", "--arch.kv-heads", "2", "--arch.intermediate-size", "2816",
    "--seq-length", "64", "--builtin-samples", "400", "--warmup-steps", "0",
]  # fmt: skip


def lora_bf16_base() -> dict:
    """Peak RSS per rank (the larger rank) of the default LoRA job under bf16 with a bf16 base, over the same job
    with --lora.base-dtype fp32; each run's rank-0 frozen-base bytes beside."""
    runs = {d: harness.train_run(2, 4, 2, 1, *LORA_BF16, "--lora.base-dtype", d) for d in ("fp32", "bf16")}
    peak = {d: max(j["peak_rss_bytes_per_rank"]) for d, j in runs.items()}
    return {
        "value": peak["bf16"] / peak["fp32"],
        "peak_rss_mib_per_rank": {d: [round(b / 2**20) for b in j["peak_rss_bytes_per_rank"]] for d, j in runs.items()},
        "frozen_mib_rank0": {d: round(j["rows"][-1]["frozen_bytes"] / 2**20, 1) for d, j in runs.items()},
        "step_time_s": {d: round(j["rows"][-1]["step_time_s"], 2) for d, j in runs.items()},
        "final_loss": {d: j["rows"][-1]["loss"] for d, j in runs.items()},
        "job": runs["bf16"]["command"],
    }


# QLoRA's memory job: ~160M parameters whose block projections (and each of 4 zero3 ranks' rows) hold whole NF4
# groups, LoRA r 16 under bf16; the 1-block job beside it measures what a rank holds before any model (imports,
# gloo, data), so that the model's own part of the peak can be set against the planner's.
QLORA_ARCH = [
    "--arch.hidden-size", "1024", "--arch.layers", "14", "--arch.heads", "8", "--arch.kv-heads", "2",
    "--arch.intermediate-size", "2816",
]  # fmt: skip
QLORA_JOB = [
    "--strategy", "zero3", "--lora.r", "16", "--mixed-precision", "bf16", "--seq-length", "64",
    "--builtin-samples", "400", "--warmup-steps", "0",
]  # fmt: skip
QLORA_BASELINE_ARCH = ["--arch.hidden-size", "256", "--arch.layers", "1", "--arch.heads", "4", "--arch.kv-heads", "4",
                       "--arch.intermediate-size", "512"]  # fmt: skip


def _planned_peak(quantize: str, recompute: str = "none") -> int:
    """meshlm plan's peak bytes per rank of the QLoRA job (4 CPU ranks, zero3, --activation-checkpointing
    `recompute`)."""
    cmd = [sys.executable, "-m", "meshlm", "plan", *QLORA_ARCH, "--device", "cpu", "--gpus-per-node", "4"]
    cmd += ["--strategy", "zero3", "--activation-checkpointing", recompute, "--seq-length", "64", "--lora.r", "16"]
    cmd += ["--mixed-precision", "bf16", "--micro-batch-size", "1", "--lora.quantize", quantize, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=harness.ENV).stdout
    return json.loads(out)["layouts"][0]["gpu_bytes"]


def _nf4_and_bf16_bases(*extra: str) -> tuple[dict, dict, int]:
    """The QLoRA job with an NF4 and with a bf16 base ({quantize: run}), each one's largest peak RSS per rank, and
    the 1-block job's (the process before any model), all with `extra` options."""
    job = [*QLORA_JOB, *extra]
    runs = {q: harness.train_run(4, 4, 2, 1, *QLORA_ARCH, *job, "--lora.quantize", q) for q in ("none", "nf4")}
    base = harness.train_run(4, 4, 2, 1, *QLORA_BASELINE_ARCH, *job)
    peak = {q: max(j["peak_rss_bytes_per_rank"]) for q, j in runs.items()}
    return runs, peak, max(base["peak_rss_bytes_per_rank"])


def lora_nf4_base() -> dict:
    """Peak RSS per rank (the largest rank) of the QLoRA job with an NF4 base over the same job with a bf16 base;
    beside it each run's rank-0 frozen bytes, and the model's part of the peak (less the 1-block job's) against
    meshlm plan's peak."""
    runs, peak, floor = _nf4_and_bf16_bases()
    planned = {q: _planned_peak(q) for q in runs}
    return {
        "value": peak["nf4"] / peak["none"],
        "peak_rss_mib_per_rank": {q: [round(b / 2**20) for b in j["peak_rss_bytes_per_rank"]] for q, j in runs.items()},
        "one_block_job_peak_mib": round(floor / 2**20),
        "model_part_ratio": (peak["nf4"] - floor) / (peak["none"] - floor),
        "model_part_mib": {q: round((p - floor) / 2**20, 1) for q, p in peak.items()},
        "planned_peak_mib": {q: round(p / 2**20, 1) for q, p in planned.items()},
        "planned_over_model_part": {q: planned[q] / (peak[q] - floor) for q in runs},
        "frozen_mib_rank0": {q: round(j["rows"][-1]["frozen_bytes"] / 2**20, 1) for q, j in runs.items()},
        "step_time_s": {q: round(j["rows"][-1]["step_time_s"], 2) for q, j in runs.items()},
        "final_loss": {q: j["rows"][-1]["loss"] for q, j in runs.items()},
        "job": runs["nf4"]["command"],
    }


def lora_nf4_model_part_recomputed() -> dict:
    """The QLoRA job of lora_nf4_base with every block recomputed in the backward (QLoRA's usual setting): the
    model's part of the peak RSS per rank (less the 1-block job's, the process that no base can shrink) with an NF4
    base over that with a bf16 base, and beside it the whole peaks' ratio and meshlm plan's peak."""
    runs, peak, floor = _nf4_and_bf16_bases("--activation-checkpointing", "full")
    planned = {q: _planned_peak(q, "full") for q in runs}
    return {
        "value": (peak["nf4"] - floor) / (peak["none"] - floor),
        "rss_ratio": peak["nf4"] / peak["none"],
        "planned_peak_mib": {q: round(p / 2**20, 1) for q, p in planned.items()},
        "planned_over_model_part": {q: planned[q] / (peak[q] - floor) for q in runs},
        "peak_rss_mib_per_rank": {q: [round(b / 2**20) for b in j["peak_rss_bytes_per_rank"]] for q, j in runs.items()},
        "one_block_job_peak_mib": round(floor / 2**20),
        "model_part_mib": {q: round((p - floor) / 2**20, 1) for q, p in peak.items()},
        "final_loss": {q: j["rows"][-1]["loss"] for q, j in runs.items()},
        "job": runs["nf4"]["command"],
    }


def grpo_reward_rise_make_train() -> dict:
    """docs/grpo.md's first recipe whole (benchmarks/grpo_curve.py from_make_train): the GRPO reward's rise."""
    import grpo_curve

    with tempfile.TemporaryDirectory() as tmp:
        got = grpo_curve.from_make_train(Path(tmp))
    return {"value": got["rise"], **got}


# GRPO's memory job: QLoRA's ~160M model and 1-block floor job (what a rank holds before any model), full
# fine-tuning on the built-in prompts, groups of 4 completions of up to 16 new tokens, one group per rank a step.
GRPO_JOB = [
    "--strategy", "zero3", "--objective", "grpo", "--mixed-precision", "bf16", "--seq-length", "128",
    "--grpo.group-size", "4", "--grpo.max-new-tokens", "16", "--lr", "1e-5", "--warmup-steps", "0",
]  # fmt: skip


def _planned_grpo_peak() -> int:
    """meshlm plan's peak bytes per rank of the GRPO job (4 CPU ranks, zero3, no recomputation)."""
    cmd = [sys.executable, "-m", "meshlm", "plan", *QLORA_ARCH, "--device", "cpu", "--gpus-per-node", "4"]
    cmd += ["--activation-checkpointing", "none", "--micro-batch-size", "4", *GRPO_JOB[:-4], "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=harness.ENV).stdout
    return json.loads(out)["layouts"][0]["gpu_bytes"]


def grpo_zero3_memory() -> dict:
    """meshlm plan's peak per rank of a GRPO step over the measured one: the largest rank's peak RSS less the
    1-block job's (QLoRA's way of setting the model's part apart)."""
    run = harness.train_run(4, 3, 1, 4, *QLORA_ARCH, *GRPO_JOB)
    base = harness.train_run(4, 3, 1, 4, *QLORA_BASELINE_ARCH, *GRPO_JOB)
    peak, floor = max(run["peak_rss_bytes_per_rank"]), max(base["peak_rss_bytes_per_rank"])
    planned = _planned_grpo_peak()
    return {
        "value": planned / (peak - floor),
        "planned_peak_mib": round(planned / 2**20, 1),
        "model_part_mib": round((peak - floor) / 2**20, 1),
        "peak_rss_mib_per_rank": [round(b / 2**20) for b in run["peak_rss_bytes_per_rank"]],
        "one_block_job_peak_mib": round(floor / 2**20),
        "generation_s": [round(r["generation_s"], 2) for r in run["rows"]],
        "step_time_s": [round(r["step_time_s"], 2) for r in run["rows"]],
        "job": run["command"],
    }


# QLoRA's accuracy and speed cost: the built-in corpus on a 4-block Llama whose projections hold whole NF4 groups
# (3.6M parameters: small enough for a loaded 2-core machine), LoRA r 16 under bf16 in one process, the same seed;
# its base in NF4 against the same base in bf16. The loss is logged every 3 steps, the first row the warm-up.
QLORA_COST = [
    "--arch.hidden-size", "256", "--arch.layers", "4", "--arch.heads", "4", "--arch.kv-heads", "4",
    "--arch.intermediate-size", "768", "--lora.r", "16", "--mixed-precision", "bf16",
]  # fmt: skip
QLORA_COST_BASES = {"nf4": ["--lora.quantize", "nf4"], "bf16": ["--lora.base-dtype", "bf16"]}
QLORA_COST_STEPS = 30


@functools.cache
def _qlora_cost_runs() -> dict:
    """The two jobs, run once for both of their cases."""
    return {b: harness.train_run(1, QLORA_COST_STEPS, 3, 4, *QLORA_COST, *a) for b, a in QLORA_COST_BASES.items()}


def lora_nf4_loss() -> dict:
    """The accuracy cost: the last logged loss with an NF4 base over the same job's with a bf16 base; both loss
    curves beside."""
    runs = _qlora_cost_runs()
    return {
        "value": runs["nf4"]["rows"][-1]["loss"] / runs["bf16"]["rows"][-1]["loss"],
        "logged_steps": [r["step"] for r in runs["nf4"]["rows"]],
        "loss_curve": {b: [round(r["loss"], 4) for r in j["rows"]] for b, j in runs.items()},
        "job": runs["nf4"]["command"],
    }


def lora_nf4_step_time() -> dict:
    """The speed cost: the mean time of a step after the warm-up row with an NF4 base over the same job's with a
    bf16 base (each projection dequantised in forward and again in backward); the runs' CPU seconds beside."""
    runs = _qlora_cost_runs()
    mean = {b: sum(r["step_time_s"] for r in j["rows"][1:]) / (len(j["rows"]) - 1) for b, j in runs.items()}
    return {
        "value": mean["nf4"] / mean["bf16"],
        "step_time_s": {b: round(m, 3) for b, m in mean.items()},
        "cpu_s_with_startup": {b: round(j["cpu_s"], 1) for b, j in runs.items()},
        "job": runs["nf4"]["command"],
    }


# The same comparison on the Alpaca job (vs_accelerate.alpaca_job: 3000 records, a BPE tokenizer trained on them, a
# random Llama whose projections hold whole NF4 groups: 256 x 256, 128 x 256, 704 x 256), its records packed into
# batches of 8 x 128 tokens as in the Accelerate comparison, 5% of them held out and evaluated after the last step.
QLORA_ALPACA_RECORDS, QLORA_ALPACA_STEPS = 3000, 60
QLORA_ALPACA = [
    "--lora.r", "16", "--mixed-precision", "bf16", "--eval-fraction", "0.05", "--eval-every", str(QLORA_ALPACA_STEPS),
]  # fmt: skip


def lora_nf4_alpaca_loss() -> dict:
    """The accuracy cost on the Alpaca job: the last logged training loss with an NF4 base over the same job's
    with a bf16 base, both loss curves and both held-out losses after the last step beside."""
    from vs_accelerate import alpaca_job  # torch and transformers only when the case runs: render.py imports this

    with tempfile.TemporaryDirectory() as root:
        data = alpaca_job(Path(root), QLORA_ALPACA_RECORDS)
        runs = {
            b: harness.train_run(1, QLORA_ALPACA_STEPS, 6, 8, *data, *QLORA_ALPACA, *a)
            for b, a in QLORA_COST_BASES.items()
        }
    return {
        "value": runs["nf4"]["rows"][-1]["loss"] / runs["bf16"]["rows"][-1]["loss"],
        "logged_steps": [r["step"] for r in runs["nf4"]["rows"]],
        "loss_curve": {b: [round(r["loss"], 4) for r in j["rows"]] for b, j in runs.items()},
        "eval_loss": {b: round(j["rows"][-1]["eval_loss"], 4) for b, j in runs.items()},
        "eval_loss_ratio": runs["nf4"]["rows"][-1]["eval_loss"] / runs["bf16"]["rows"][-1]["eval_loss"],
        "job": runs["nf4"]["command"].replace(root, "ROOT"),
    }


GPU = "PYTHONPATH=src python3 benchmarks/gpu_check.py --deadline 560   # on one GPU, carrying .whl"

SUITES = (
    Suite(
        "default_job",
        "The default job",
        "`meshlm train`'s default job (the built-in Llama-style model, 0.82M parameters, the built-in corpus in "
        "blocks of 128, AdamW, fp32) in one process, run through the harness: a smoke figure of the machine, "
        "not a target.",
        (
            Case("default-job-tokens", "default job, 1 process, tokens/s after warm-up", "tokens/s",
                 DEFAULT_JOB + " default-job-tokens", measure=default_job_tokens),
            Case("default-job-cpu-step", "default job, 1 process, CPU ms per step (40 steps less 20)", "ms",
                 DEFAULT_JOB + " default-job-cpu-step", measure=default_job_cpu),
        ),
    ),
    Suite(
        "peers",
        "Against Accelerate, hand-written loops and torchtitan",
        "The same job written the way each peer writes it, the sides taking turns (on CPU best of 3). Against "
        "Accelerate the notebook holds three figures for the Alpaca job (0.98x and 1.06x on 2026-11-25, 1.15-1.19x on "
        "2026-11-27): the row is the newest measurement, taken after the loss head stopped making logits for "
        "positions without a target; its lower run is the value, the second run gave 1.19x.",
        (
            Case("accelerate-alpaca", "meshlm / Accelerate tokens/s, Alpaca job, ddp on 2 CPU ranks", "x",
                 VS_ACCELERATE, (">=", 1.0)),
            Case("accelerate-alpaca-memory", "meshlm / Accelerate rank 0 peak memory, Alpaca job", "x",
                 VS_ACCELERATE, ("<=", 1.0)),
            Case("accelerate-builtin", "meshlm / Accelerate tokens/s, built-in job, ddp on 2 CPU ranks", "x",
                 "python benchmarks/vs_accelerate.py --layouts ddp --repeats 3", (">=", 1.2)),
            Case("handwritten-overhead", "meshlm / hand-written loop tokens/s, lowest of ddp, zero3, tp (2 ranks)",
                 "x", "python benchmarks/overhead.py --repeats 3", (">=", 0.97)),
            Case("torchtitan-1b", "meshlm / torchtitan 0.2.2 tokens/s, ~1B Llama bf16 flex, one H200", "x",
                 GPU + " --only torchtitan", (">=", 1.0)),
        ),
    ),
    Suite(
        "cpu_cost",
        "CPU time per step",
        "CPU seconds of every process of a job over the steps of a long run less a short one: start-up cancels, "
        "and other tenants move it less than tokens/s. For the built-in job the row is the newest measurement "
        "(2026-11-25: 1.35x), not 2026-11-22's 1.03x; its two runs of meshlm differed by 1.4x (232 and 165 ms), "
        "so even CPU time is not steady on a shared machine.",
        (
            Case("cpu-step-builtin", "meshlm / Accelerate CPU ms per step, built-in job, ddp on 2 ranks", "x",
                 "python benchmarks/cpu_cost.py --repeats 2"),
            Case("cpu-step-alpaca", "meshlm / Accelerate CPU ms per step, Alpaca job, ddp on 2 ranks", "x",
                 "cd benchmarks && python cpu_cost.py --job alpaca --short 20 --long 40 --repeats 2"),
        ),
    ),
    Suite(
        "scaling",
        "Scaling",
        "Each rank takes micro-batches of 8; efficiency = tokens/s(N) / (N x tokens/s(1)). Two quiet runs gave "
        "0.92 and 0.78 for ddp on 2 ranks; the row is the newer.",
        (Case("scaling-ddp-2", "ddp efficiency from 1 to 2 CPU ranks", "", "python benchmarks/scaling.py --repeats 2",
              (">=", 0.85)),),
    ),
    Suite(
        "memory",
        "Peak memory per rank",
        "A ~160M Llama (610 MiB in fp32) loaded with `--pretrained`: the peak RSS of each 4-rank layout above the "
        "fixed cost of a tiny model, as a fraction of the one-process job's.",
        (
            Case("peak-zero3-x4", "zero3 on 4 ranks, peak / one process", "", PEAK.format("zero3 x4"), ("<=", 0.40)),
            Case("peak-tp-4", "tp 4, peak / one process", "", PEAK.format("tp 4"), ("<=", 0.40)),
            Case("peak-pp-4", "pp 4, peak / one process", "", PEAK.format("pp 4"), ("<=", 0.40)),
            Case("peak-fsdp2-tp2", "fsdp 2 x tp 2, peak / one process", "", PEAK.format("fsdp 2 x tp 2"),
                 ("<=", 0.40)),
            Case("peak-generate-pp-4", "generate pp 4, peak / one process", "", PEAK.format("generate pp 4"),
                 ("<=", 0.40)),
            Case("moe-ep4-expert-state", "MoE: expert state per rank under ep 4 / ddp 4", "",
                 "python benchmarks/moe.py", ("<=", 0.30)),
            Case("lora-r8-state", "LoRA r=8 model state per rank / full fine-tuning, ddp 2", "",
                 "PYTHONPATH=src python benchmarks/lora.py --steps 12"),
            Case("lora-bf16-base-rss", "LoRA r=8 zero3 x2 under bf16: peak RSS per rank, bf16 base / fp32 base", "",
                 "PYTHONPATH=src python benchmarks/run.py memory lora-bf16-base-rss", measure=lora_bf16_base),
            Case("lora-nf4-base-rss", "QLoRA r=16 zero3 x4 (~160M): peak RSS per rank, NF4 base / bf16 base", "",
                 "PYTHONPATH=src python benchmarks/run.py memory lora-nf4-base-rss", ("<=", 0.45),
                 measure=lora_nf4_base),
            Case("lora-nf4-model-part-recomputed",
                 "QLoRA r=16 zero3 x4 (~160M), every block recomputed: the model's part of the peak RSS per rank "
                 "(less the 1-block job's), NF4 base / bf16 base", "",
                 "PYTHONPATH=src python benchmarks/run.py memory lora-nf4-model-part-recomputed", ("<=", 0.45),
                 measure=lora_nf4_model_part_recomputed),
            Case("grpo-plan-memory-zero3-x4", "GRPO zero3 x4 (~160M): meshlm plan's peak per rank / measured", "",
                 "PYTHONPATH=src python benchmarks/run.py memory grpo-plan-memory-zero3-x4", ("within", 0.15),
                 measure=grpo_zero3_memory),
        ),
    ),
    Suite(
        "qlora",
        "QLoRA's costs",
        "`--lora.quantize nf4` against the same LoRA job with its base in bf16 (docs/lora.md), LoRA r 16 under bf16, "
        "one process, the same seed: the built-in corpus on a 4-block Llama (3.6M parameters) whose projections "
        "hold whole NF4 groups, 30 steps; and the Alpaca job of the Accelerate comparison (3000 generated records, "
        "a BPE tokenizer trained on them, a random 4-block Llama), 60 steps, 5% of the records held out and "
        "evaluated after the last step. The Alpaca job's text is random letters and its head and embedding stay "
        "frozen, so the adapters lower its loss little: there the ratio shows NF4 costs nothing measurable, a "
        "weaker check than real text would give.",
        (
            Case("lora-nf4-loss", "QLoRA last loss after 30 steps, NF4 base / bf16 base", "",
                 "PYTHONPATH=src python benchmarks/run.py qlora", measure=lora_nf4_loss),
            Case("lora-nf4-step-time", "QLoRA time per step, NF4 base / bf16 base", "x",
                 "PYTHONPATH=src python benchmarks/run.py qlora", measure=lora_nf4_step_time),
            Case("lora-nf4-alpaca-loss", "QLoRA on the Alpaca job: last loss after 60 steps, NF4 base / bf16 base",
                 "", "PYTHONPATH=src python benchmarks/run.py qlora lora-nf4-alpaca-loss",
                 measure=lora_nf4_alpaca_loss),
        ),
    ),
    Suite(
        "planner",
        "The planner against measurements",
        "`meshlm plan`'s predictions against the same layouts run for real or simulated.",
        (
            Case("plan-validate-defaults", "worst activation peak predicted / measured, plan --validate --nproc 2",
                 "", "meshlm plan --validate --nproc 2", ("within", 0.20)),
            Case("plan-validate-1b-gpu", "activation peak predicted / measured, ~1B on one H200", "",
                 GPU + " --only validate", ("within", 0.20)),
            Case("plan-long-sequences", "worst planned / measured peak, long-sequence ladder", "",
                 "cd benchmarks && python long_sequences.py", ("within", 0.15)),
            Case("plan-moe-235b-time", "Qwen3-235B preset --simulate, wall time", "s",
                 "meshlm plan --model qwen3-235b-a22b --nodes 8 --gpus-per-node 8 --simulate", ("<=", 180)),
        ),
    ),
    Suite(
        "long_sequences",
        "Long sequences",
        "A Llama with vocabulary 32000 at a budget of 900 MiB per rank on 4 CPU ranks.",
        (
            Case("cp4-sequence", "longest sequence within the budget, cp 4 / ddp", "x",
                 "cd benchmarks && python long_sequences.py", (">=", 3.5)),
            Case("chunked-loss-8192", "peak saved by the chunked loss at 8192 tokens, one process", "MiB",
                 "cd benchmarks && python long_sequences.py", (">=", 1000)),
        ),
    ),
    Suite(
        "throughput",
        "Pipeline, generation, packing",
        "Shapes of a step rather than speed against a peer.",
        (
            Case("pipeline-bubble", "worst bubble gap above (P-1)/(M+P-1), M >= 4, P = 2", "points",
                 "python benchmarks/pipeline.py", ("<=", 5)),
            Case("generate-dp2", "meshlm generate dp on 2 ranks / 1 rank, tokens/s", "x",
                 "python benchmarks/generate.py --repeat 1", (">=", 1.7)),
            Case("packing-best-fit", "best fit / next fit, target tokens/s, blocks of 1024", "x",
                 "cd benchmarks && python packing.py --seq-length 1024"),
        ),
    ),
    Suite(
        "gpu",
        "GPU",
        "One GPU lent through the device tool; the campaign below tells each lease.",
        (
            Case("gpu-mfu-1b-flex", "MFU, ~1B Llama bf16, --attention flex, seq 2048, one H200", "%",
                 GPU, (">=", 45)),
            Case("gpu-float8-1b", "float8 tensorwise / bf16 tokens/s, ~1B (target stated at ~3B)", "x", GPU),
        ),
    ),
    Suite(
        "grpo",
        "GRPO from the supervised model",
        "docs/grpo.md's recipes on 2 CPU ranks (zero3): GRPO with the exact-match reward from make train's model "
        "on the built-in majority prompts, and from the built-in model after `meshlm train --max-steps 6000` on the "
        "copy and reverse prompts; and one GRPO job "
        "(benchmarks/grpo_trl.py: a random Llama, 32 prompts, groups of 4, 32 new tokens) against TRL's GRPOTrainer "
        "with transformers' generate, both on ddp over 2 CPU ranks, best of 3 each, the sides taking turns.",
        (
            Case("grpo-reward-rise-make-train", "mean reward, last 20 steps less the first 20, within 15 min of wall "
                 "time, from make train's model, majority prompts", "",
                 "PYTHONPATH=src python benchmarks/run.py grpo grpo-reward-rise-make-train", (">=", 0.10),
                 measure=grpo_reward_rise_make_train),
            Case("grpo-reward-rise", "mean reward, last 20 steps less the first 20, within 15 min of wall time, "
                 "from the 6000-step supervised model, copy and reverse prompts", "",
                 "docs/grpo.md's recipe, then python benchmarks/grpo_curve.py curve outputs/grpo", (">=", 0.10)),
            Case("grpo-vs-trl-throughput", "meshlm / TRL GRPOTrainer steps/s, same job, ddp on 2 CPU ranks", "x",
                 "PYTHONPATH=src python benchmarks/grpo_trl.py --nproc 2 --steps 8 --warmup 2 --record", (">=", 1.0)),
        ),
    ),
    Suite(
        "parity",
        "Parity and supported releases",
        "Largest relative difference from one process or from a peer (losses within 1e-4 over 3 steps for a family's "
        "cell); the supported release range's test runs.",
        (
            Case("parity-tp2-sp", "tp 2 + sequence parallel loss vs one process, torch 2.11-2.15", "",
                 "pytest tests/test_model_parallel.py", ("<=", 2e-6)),
            Case("parity-zero3-2", "zero3 2 loss vs one process, torch 2.11-2.15", "",
                 "pytest tests/test_sharded.py", ("<=", 1e-5)),
            Case("dpo-trl", "DPO against TRL's DPOTrainer: largest relative difference, 2 steps", "",
                 "PYTHONPATH=src:tests python benchmarks/dpo.py trl", ("<=", 1e-5)),
            Case("families-all-layouts", "families equal to one process under zero3 2, tp 2 and pp 2", "of 96",
                 "python benchmarks/families.py"),
            Case("families-sequence-parallel", "families equal to one process under tp 2 + sequence parallel",
                 "of 80", "python benchmarks/families.py --sp"),
            Case("release-range-transformers", "tests failed, transformers 5.17.0 / 5.20.2 / 5.24.0", "",
                 "make test-compat TRANSFORMERS=5.17.0 (and 5.20.2, 5.24.0)", ("<=", 0)),
            Case("release-range-torch", "default job losses, torch 2.11 and 2.15 against 2.13", "",
                 "pytest tests/test_release_range.py (in each torch's venv)", ("<=", 1e-6)),
        ),
    ),
)  # fmt: skip


def by_name(name: str) -> Suite:
    for s in SUITES:
        if s.name == name:
            return s
    raise SystemExit(f"no suite {name!r}: " + ", ".join(s.name for s in SUITES))


def case(case_id: str) -> tuple[Suite, Case]:
    for s in SUITES:
        for c in s.cases:
            if c.id == case_id:
                return s, c
    raise KeyError(case_id)
