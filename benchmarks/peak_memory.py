"""Peak resident memory per rank of a ~160M Llama under each 4-rank layout, against one process.

A Llama of hidden 1024, 8 blocks, 16 heads / 8 key-value heads, MLP 2816, vocabulary 32000, untied, saved
as safetensors, loaded with --pretrained; 2 training steps at micro-batch 1 x 128 tokens, on CPU ranks. For
each job: the peak RSS of its largest process (the kernel's ru_maxrss over every process the job ran, read
in a fresh wrapper process per job), minus the fixed cost (the same job with a tiny model: torch and
transformers themselves), next to the full model's fp32 bytes and the planner's predicted peak per GPU.

    python benchmarks/peak_memory.py            # prints the table (about 10 minutes on 2 cores)
    python benchmarks/peak_memory.py --only "zero3 x4,fsdp 2 x tp 2"   # those rows and their one-process row
    python benchmarks/peak_memory.py --profile "zero3 x4"   # that training job's peak RSS per phase and rank

--profile runs the job's ranks through torchrun with benchmarks/rss_phases.py, which samples each rank's RSS
every 3 ms and at every FSDP unit's forward and backward, and prints the peak of each phase per rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from harness import largest_rss
from transformers import LlamaConfig, LlamaForCausalLM

from meshlm.data.builtin import byte_tokenizer

TRAIN = [
    "--pretrained",
    "--max-steps",
    "2",
    "--micro-batch-size",
    "1",
    "--seq-length",
    "128",
    "--builtin-samples",
    "200",
    "--progress",
    "false",
    "--save-final",
    "false",
    "--log-every",
    "1",
]
LAYOUTS = {  # name -> (meshlm train arguments, the planner's layout name, global batch)
    "single": ([], "single", 1),
    "zero3 x4": (["--nproc", "4", "--strategy", "zero3"], "zero3", 4),
    "tp 4": (["--nproc", "4", "--parallel.tp", "4"], "tp4", 1),
    "pp 4": (
        ["--nproc", "4", "--parallel.pp", "4", "--micro-batch-size", "4", "--parallel.micro-batches", "4"],
        "pp4",
        4,
    ),
    "fsdp 2 x tp 2": (["--nproc", "4", "--strategy", "fsdp", "--parallel.tp", "2"], "zero3 tp2", 2),
}
GENERATE = {
    "generate single": [],
    "generate tp 4": ["--mode", "tp", "--nproc", "4"],
    "generate pp 4": ["--mode", "pp", "--nproc", "4"],
}


def save_model(path: Path, hidden: int, layers: int, heads: int, kv: int, mlp: int, vocab: int) -> int:
    """A random Llama saved as safetensors with the byte tokenizer; returns its fp32 bytes."""
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=mlp,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return 4 * sum(p.numel() for p in model.parameters())


def peak_rss(args: list[str]) -> int:
    """ru_maxrss (bytes) of the largest process of `meshlm ARGS`."""
    return largest_rss([sys.executable, "-m", "meshlm", *args])


def planned(model: Path, plan_layout: str, global_batch: int) -> int:
    """The planner's peak of the fullest rank for this layout on CPU ranks (fp32, the same micro-batch, length
    and batch): the larger of its training and start-up peaks."""
    world = "1" if plan_layout == "single" else "4"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshlm",
            "plan",
            "--model",
            str(model),
            "--gpus-per-node",
            world,
            "--precision",
            "fp32",
            "--seq-length",
            "128",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            str(global_batch),
            "--activation-checkpointing",
            "none",
            "--device",
            "cpu",  # these are CPU ranks: their peak is priced as resident memory (docs/plan.md)
            "--all",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {r["layout"]: r for r in json.loads(p.stdout)["layouts"]}
    row = rows.get(plan_layout)
    return max(row["gpu_bytes"], row["startup_bytes"]) if row else 0


def measure(root: Path, big: Path, tiny: Path, only: set[str]) -> list[tuple]:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i} ="}) + "\n" for i in range(4)))
    rows = []
    for name, (args, plan_layout, global_batch) in LAYOUTS.items():
        if name not in only:
            continue
        fixed = peak_rss(["train", "--model-name", str(tiny), *TRAIN, *args, "--output-dir", str(root / "t")])
        peak = peak_rss(["train", "--model-name", str(big), *TRAIN, *args, "--output-dir", str(root / "b")])
        rows.append((name, peak, fixed, planned(big, plan_layout, global_batch)))
        print(f"  measured {name}", file=sys.stderr)
    for name, args in GENERATE.items():
        if name not in only:
            continue
        gen = ["generate", "--prompts", str(prompts), "--max-new-tokens", "4", "--overwrite", *args]
        fixed = peak_rss([*gen, "--model-name", str(tiny), "--out", str(root / "t.jsonl")])
        peak = peak_rss([*gen, "--model-name", str(big), "--out", str(root / "b.jsonl")])
        rows.append((name, peak, fixed, 0))
        print(f"  measured {name}", file=sys.stderr)
    return rows


def selected(only: str | None) -> set[str]:
    """The rows asked for, with the one-process row each is compared against."""
    if not only:
        return set(LAYOUTS) | set(GENERATE)
    names = {n.strip() for n in only.split(",")}
    unknown = names - set(LAYOUTS) - set(GENERATE)
    if unknown:
        raise SystemExit(f"--only: unknown rows {sorted(unknown)}; choose from {[*LAYOUTS, *GENERATE]}")
    return names | {"generate single" if n.startswith("generate") else "single" for n in names}


def profile(name: str) -> None:
    """The training job `name` (a row of LAYOUTS) with each rank's peak RSS per phase (benchmarks/rss_phases.py)."""
    args, _, _ = LAYOUTS[name]
    nproc = int(args[args.index("--nproc") + 1]) if "--nproc" in args else 1
    layout = [a for i, a in enumerate(args) if a != "--nproc" and (i == 0 or args[i - 1] != "--nproc")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full = save_model(root / "big", 1024, 8, 16, 8, 2816, 32000)
        train = ["train", "--model-name", str(root / "big"), *TRAIN, *layout, "--output-dir", str(root / "run")]
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            + [str(Path(__file__).with_name("rss_phases.py")), str(root / "rss"), *train],
            capture_output=True,
            text=True,
        )
        if p.returncode:
            raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
        ranks = [json.loads((root / "rss" / f"rank-{r}.json").read_text()) for r in range(nproc)]
    mib = 2**20
    print(
        f"{name}: peak RSS per phase and rank, MiB (full model fp32 {full / mib:,.0f} MiB; {' '.join(TRAIN + layout)})"
    )
    print(f"{'phase':<40}" + "".join(f"{'rank ' + str(r):>10}" for r in range(nproc)))
    for phase in ranks[0]:
        print(f"{phase:<40}" + "".join(f"{rank.get(phase, 0) / mib:>10,.0f}" for rank in ranks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated rows to measure (e.g. 'zero3 x4,tp 4'); default: all")
    parser.add_argument("--profile", choices=list(LAYOUTS), help="one training job's peak RSS per phase and rank")
    options = parser.parse_args()
    if options.profile:
        return profile(options.profile)
    only = selected(options.only)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full = save_model(root / "big", 1024, 8, 16, 8, 2816, 32000)
        save_model(root / "tiny", 64, 4, 4, 4, 128, 320)  # 4 blocks and 4 kv heads: tp 4 and pp 4 run on it
        rows = measure(root, root / "big", root / "tiny", only)
    mib = 2**20
    base = {
        kind: next(p - f for n, p, f, _ in rows if n == one)
        for kind, one in (("train", "single"), ("generate", "generate single"))
        if one in only
    }
    print(f"full model fp32: {full / mib:,.0f} MiB")
    print(
        f"{'job':<18} {'peak MiB':>9} {'fixed MiB':>10} {'above fixed':>12} {'of 1 process':>13} "
        f"{'plan MiB':>9} {'plan/measured':>14}"
    )
    for name, peak, fixed, plan in rows:
        above = peak - fixed
        share = above / base["generate" if name.startswith("generate") else "train"]
        ratio = f"{plan / above:.2f}" if plan else "-"
        print(
            f"{name:<18} {peak / mib:>9,.0f} {fixed / mib:>10,.0f} {above / mib:>12,.0f} {share:>13.2f} "
            f"{plan / mib if plan else 0:>9,.0f} {ratio:>14}"
        )


if __name__ == "__main__":
    main()
