"""`meshlm generate`: batch generation in this process, or on `--nproc N` ranks through launch.py."""

from __future__ import annotations

import argparse

from meshlm import options
from meshlm.config import ATTENTION_KERNELS
from meshlm.errors import MeshlmError
from meshlm.options import number

DESCRIPTION = (
    "Generate completions for a file of prompts; writes one .jsonl record per "
    "prompt (input order) and a .json metrics summary."
)


def _generate_options(args):
    from meshlm.infer.decode import Sampling
    from meshlm.infer.generate import GenerateOptions
    from meshlm.infer.load import ModelChoice

    temperature = 0.0 if args.greedy else args.temperature
    return GenerateOptions(
        prompts=args.prompts,
        prompts_split=args.prompts_split,
        out=args.out,
        summary=args.summary,
        overwrite=args.overwrite,
        mode=args.mode,
        devices=args.devices,
        micro_batches=args.micro_batches,
        model=ModelChoice(
            args.model_name, args.checkpoint, args.tokenizer_name, args.trust_remote_code, args.dtype, args.attention
        ),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        sampling=Sampling(temperature, args.top_p, args.seed),
        truncate=args.truncate,
        backend=args.backend,
    )


def run(args, argv: list[str]) -> int:
    from meshlm.infer.generate import prepare, run

    opts = _generate_options(args)
    options.choose_gpus(args.gpus, args.nproc)
    if args.nproc is None:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(run)(opts)
        return 0
    from meshlm.launch import LaunchOptions, launch

    if args.nproc < 1:
        raise MeshlmError(f"--nproc must be at least 1, got {args.nproc} (leave it out to run in this process)")
    prepare(opts, args.nproc)  # bad input fails here, before any rank starts
    # a generating rank parses its arguments as `meshlm generate` does: run() shows its errors
    job = ["generate", *options.strip_launch_flags(argv)]
    return launch("meshlm.cli:run", (job,), LaunchOptions(args.nproc, omp_threads=args.omp_threads), None)


def add_options(g: argparse.ArgumentParser) -> None:
    for add in (_generate_model_options, _generate_io_options, _generate_layout_options, _generate_decoding_options):
        add(g)


def _generate_model_options(g: argparse.ArgumentParser) -> None:
    m = g.add_argument_group("model (exactly one of --model-name and --checkpoint)")
    m.add_argument("--model-name", default="", help="transformers directory (e.g. an export) or hub id")
    m.add_argument(
        "--checkpoint",
        default="",
        help="meshlm checkpoint from any training layout: outputs/RUN (its latest), or outputs/RUN/checkpoints/step-N",
    )
    m.add_argument("--tokenizer-name", default="", help="tokenizer directory or hub id [default: the model's]")
    m.add_argument("--trust-remote-code", action="store_true", help="allow custom code from the model's repository")
    m.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weights and compute dtype",
    )
    m.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_KERNELS,
        help="attention kernel, as meshlm train's --attention (docs/attention.md); the log names the one used",
    )


def _generate_io_options(g: argparse.ArgumentParser) -> None:
    io = g.add_argument_group("prompts and results")
    io.add_argument(
        "--prompts",
        default="",
        help=".jsonl ('prompt' field, or Alpaca 'instruction'/'input' formatted as in training), "
        ".txt (one prompt per non-empty line), or a dataset id / directory",
    )
    io.add_argument("--prompts-split", default="train", help="split of a dataset given to --prompts")
    io.add_argument("--out", default="", help=".jsonl to write: one record per prompt, in input order")
    io.add_argument("--summary", default="", help="metrics .json [default: OUT with .summary.json]")
    io.add_argument("--overwrite", action="store_true", help="replace an existing --out / --summary")
    io.add_argument(
        "--truncate",
        action="store_true",
        help="cut prompts that do not fit the model's positions (keeping their last tokens) "
        "instead of stopping with an error",
    )


def _generate_layout_options(g: argparse.ArgumentParser) -> None:
    lay = g.add_argument_group("layout")
    lay.add_argument(
        "--mode",
        default="dp",
        help="dp: every rank holds the model and takes a slice of the prompts; tp: one model sharded "
        "across the ranks (tensor parallel); pp: the model cut into one stage per rank, "
        "micro-batches of prompts flowing through them; layer-split: one process, layers spread "
        "over --devices, only one device computes at a time (for a model larger than one "
        "device, not for speed) {dp, tp, pp, layer-split}",
    )
    lay.add_argument("--devices", default="", help="layer-split devices, e.g. cuda:0,cuda:1 (cpu,cpu on CPU)")
    lay.add_argument(
        "--micro-batches",
        type=number("micro-batches"),
        default=0,
        help="pp: micro-batches in flight [default: the number of stages]",
    )
    lay.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "nccl", "gloo"),
        help="process group backend (auto: nccl with CUDA, else gloo)",
    )
    options.add_nproc_option(lay)
    options.add_omp_threads_option(lay)
    options.add_gpus_option(lay)


def _generate_decoding_options(g: argparse.ArgumentParser) -> None:
    d = g.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=number("max-new-tokens"), default=64, help="tokens to generate at most")
    d.add_argument(
        "--batch-size",
        type=number("batch-size"),
        default=8,
        help="prompts per batch (per rank in dp, per micro-batch in pp)",
    )
    s = d.add_mutually_exclusive_group()
    s.add_argument("--greedy", action="store_true", help="pick the most likely token (the default)")
    s.add_argument(
        "--temperature", type=number("temperature", float), default=0.0, help="sample with this temperature (0: greedy)"
    )
    d.add_argument("--top-p", type=number("top-p", float), default=1.0, help="nucleus sampling: keep this much mass")
    d.add_argument(
        "--seed",
        type=number("seed"),
        default=0,
        help="sampling seed; prompt i uses seed + i, so samples do not depend on the rank count",
    )
