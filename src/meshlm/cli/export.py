"""`meshlm export`: a checkpoint as a Hugging Face model directory (train/export.py does the work)."""

from __future__ import annotations

import argparse

DESCRIPTION = "Consolidate a sharded checkpoint into safetensors + config + tokenizer."


def add_options(x: argparse.ArgumentParser) -> None:
    x.add_argument("--checkpoint", required=True, help="run directory, its checkpoints/, or a checkpoints/step-N")
    x.add_argument("--out", required=True, help="new directory for the Hugging Face model")
    x.add_argument(
        "--trust-remote-code", action="store_true", help="allow the model repository's code (never from config.toml)"
    )
    x.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA runs: write the adapters as a PEFT directory (PeftModel.from_pretrained) instead of "
        "the merged model",
    )
    x.add_argument(
        "--push-to-hub",
        default="",
        metavar="REPO",
        help="then upload the export to this Hub model repository (created if missing; huggingface_hub's token)",
    )


def run(args, argv) -> int:
    from meshlm.train.export import export, push_to_hub

    out = export(args.checkpoint, args.out, args.trust_remote_code, args.adapter_only)
    print(f"exported {out}")
    if args.push_to_hub:
        print(f"pushed to {push_to_hub(out, args.push_to_hub)}")
    return 0
