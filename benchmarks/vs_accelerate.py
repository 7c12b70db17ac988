"""meshlm train (its defaults) against the same job written the Accelerate way, on 2 processes.

    python benchmarks/vs_accelerate.py [--steps 60] [--warmup 10] [--repeats 3] [--compile] [--job builtin|alpaca]

The Accelerate side is benchmarks/accelerate_job.py under `accelerate launch` (DDP: --multi_gpu
launcher; FSDP: --use_fsdp --fsdp_version 2, block-wise auto wrap, reshard after forward). On a
machine without CUDA both sides run CPU processes with gloo, one OpenMP thread each. Reported:
tokens/s after warm-up, rank 0's peak memory, the final loss (mean of the last interval), and
meshlm / Accelerate throughput. Target: >= 1.2x with equal or lower memory. --compile adds a row for
`meshlm train --compile true` (steady tokens/s; the warm-up interval holds the compile, its time is printed).
A side that cannot run the layout says so (meshlm: verify's availability check; Accelerate:
the distributed type it reports, since it falls back to DDP where FSDP is not supported).

--job alpaca is a new user's fine-tuning job: a local Llama (transformers' LlamaConfig: hidden 256, 4 blocks,
4 / 2 heads, MLP 704, vocabulary 4096 from a BPE tokenizer trained on the data, random, saved to a temp dir) and
an Alpaca JSONL of --records records written here (lognormal lengths as benchmarks/packing.py's, no network);
meshlm packs whole records with a document mask (its defaults), the Accelerate side is the classic recipe
(records concatenated into blocks, plain causal attention: accelerate_job.py --dataset-name). Batch 8 x 128.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
from harness import HERE, available, best, mib, script, train
from packing import alpaca_like

FSDP_FLAGS = [
    "--use_fsdp",
    "--fsdp_version",
    "2",
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "LlamaDecoderLayer",
    "--fsdp_reshard_after_forward",
    "true",
]


def alpaca_job(root: Path, records: int) -> list[str]:
    """The Alpaca JSONL, a BPE tokenizer trained on it and a random Llama, under `root` -> the data options."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    data, model_dir = root / "alpaca.jsonl", root / "llama"
    alpaca_like(data, records)
    texts = [v for line in data.read_text().splitlines() for v in json.loads(line).values() if v]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=704,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return ["--model-name", str(model_dir), "--dataset-name", str(data)]


def accelerate(layout: str, steps: int, warmup: int, data: list[str]) -> dict:
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    launch += FSDP_FLAGS if layout == "fsdp" else ["--multi_gpu"]
    cpu = [] if torch.cuda.is_available() else ["--cpu"]
    return script(
        launch,
        HERE / "accelerate_job.py",
        *cpu,
        *data,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--micro-batch",
        "8",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="ddp,fsdp")
    ap.add_argument("--compile", action="store_true", help="also run meshlm with --compile (one more row per layout)")
    ap.add_argument("--job", choices=("builtin", "alpaca"), default="builtin")
    ap.add_argument("--records", type=int, default=3000, help="--job alpaca: records in the generated JSONL")
    args = ap.parse_args()
    assert args.steps % args.warmup == 0, "--steps must be a multiple of --warmup"
    with tempfile.TemporaryDirectory() as root:
        data = alpaca_job(Path(root), args.records) if args.job == "alpaca" else []
        compare(args, data)


def compare(args, data: list[str]) -> None:
    what = f"the Alpaca job ({args.records} records, Llama hidden 256 x 4)" if data else "built-in model"
    print(
        f"vs Accelerate: {what}, micro-batch 8 x 2 processes, {args.steps} steps ({args.warmup} warm-up), "
        f"1 thread per process, best of {args.repeats}; memory = rank 0's peak"
    )
    print(f"{'layout':<8}{'side':<12}{'tokens/s':>10}{'peak MiB':>10}{'final loss':>12}  notes")
    for layout in args.layouts.split(","):
        why = available(layout, 2, "auto" if layout == "ddp" else layout)
        extra = ["--strategy", layout, *data]
        jobs = [partial(accelerate, layout, args.steps, args.warmup, data)]
        if not why:
            jobs.append(partial(train, 2, args.steps, args.warmup, 8, *extra))
            if args.compile:
                jobs.append(partial(train, 2, args.steps, args.warmup, 8, *extra, "--compile", "true"))
        acc, *ours = best(args.repeats, *jobs)
        kind = acc["distributed_type"].split(".")[-1]
        fell_back = layout == "fsdp" and kind != "FSDP"
        note = f"Accelerate ran {kind}: no FSDP on this device type" if fell_back else kind
        print(
            f"{layout:<8}{'accelerate':<12}{acc['tokens_per_s']:>10,.0f}{mib(acc['peak_bytes']):>10}"
            f"{acc['loss']:>12.4f}  {note}",
            flush=True,
        )
        if why:
            print(f"{layout:<8}{'meshlm':<12}  {why}")
            continue
        for side, run in zip(("meshlm", "+compile"), ours):
            ratio = run["tokens_per_s"] / acc["tokens_per_s"]
            mem = "lower" if run["peak_bytes"] <= acc["peak_bytes"] else "HIGHER"
            took = (
                f"; its first {args.warmup} steps (compiling) took {run['warmup_s']:.0f} s" if side != "meshlm" else ""
            )
            print(
                f"{layout:<8}{side:<12}{run['tokens_per_s']:>10,.0f}{mib(run['peak_bytes']):>10}"
                f"{run['loss']:>12.4f}  {ratio:.2f}x Accelerate's tokens/s (target >= 1.2), memory {mem}"
                f"{' (Accelerate was not sharding)' if fell_back else ''}{took}",
                flush=True,
            )


if __name__ == "__main__":
    main()
