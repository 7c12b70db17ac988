"""Sub-commands and argument parsing only; the work happens in the modules they call."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from meshlm import options
from meshlm.errors import EXIT_USAGE, MeshlmError
from meshlm.options import Parser, add_config_options, number


def cmd_train(args, argv: list[str]) -> int:
    from meshlm import config as config_mod

    cfg = config_mod.load(args.config, options.overrides(args))
    options.choose_gpus(args.gpus, args.nproc)
    if args.nproc is not None:
        return _launch_train(cfg, args, argv)
    if (args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id, args.max_restarts, args.omp_threads) != (
        1,
        0,
        "",
        "",
        0,
        0,
    ):
        raise MeshlmError(
            "--nnodes, --node-rank, --rdzv-*, --max-restarts and --omp-threads need --nproc N "
            "(ranks per node); under torchrun pass them to torchrun instead"
        )
    options.check_devices(cfg)
    if _finished(cfg, int(os.environ.get("WORLD_SIZE", "1"))):
        return 0
    from torch.distributed.elastic.multiprocessing.errors import record

    from meshlm.train.trainer import train

    record(train)(cfg)
    return 0


def _finished(cfg, world: int, gpus_wanted: int = 0, node_rank: int = 0) -> bool:
    """Rerunning a finished run's command: its input checked as a run's (the checkpoint's model included: bad
    input is one line and status 2 all the same), then say so (rank 0 under torchrun), start nothing, succeed."""
    from meshlm.checkpoint import run_dir

    done = run_dir.finished(cfg)
    if not done:
        return False
    options.check_job(cfg, world, gpus_wanted, node_rank=node_rank)
    run_dir.check_same_model(cfg)
    if os.environ.get("RANK", "0") == "0":
        print(done)
    return True


def _launch_train(cfg, args, argv: list[str]) -> int:
    """Validate what can be validated here (data included: its cache is filled now, the ranks map it), hold the
    run directory, then start the ranks with the same arguments (minus launch flags)."""
    import contextlib

    from meshlm import runtime
    from meshlm.checkpoint.run_dir import RunLock, takes_lock
    from meshlm.launch import LaunchOptions, check, launch

    runtime.setup_logging(runtime.Runtime())  # the launcher speaks as rank 0 does (e.g. while it tokenises)

    opts = LaunchOptions(
        args.nproc,
        args.nnodes,
        args.node_rank,
        args.rdzv_endpoint,
        args.rdzv_id,
        args.max_restarts,
        args.omp_threads,
        args.rdzv_timeout,
    )
    check(opts)
    if _finished(cfg, args.nproc * args.nnodes, gpus_wanted=args.nproc, node_rank=opts.node_rank):
        return 0
    options.check_job(cfg, args.nproc * args.nnodes, gpus_wanted=args.nproc, data=True, node_rank=opts.node_rank)
    # Node 0's launcher holds the run directory for every rank (they share it on a shared file system).
    with RunLock(cfg.out) if takes_lock(opts.node_rank) else contextlib.nullcontext():
        # Stopping on a signal may save a checkpoint first: as long as a stuck collective may take.
        return launch(options.strip_launch_flags(argv), opts, cfg.out, rank_main, stop_timeout_s=cfg.dist_timeout + 30)


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


def cmd_generate(args, argv: list[str]) -> int:
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
    return launch(
        options.strip_launch_flags(argv),
        LaunchOptions(args.nproc, omp_threads=args.omp_threads),
        None,
        rank_main,
        command="generate",
    )


def _add_generate_options(g: argparse.ArgumentParser) -> None:
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
        choices=("auto", "sdpa", "flex", "varlen"),
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
    lay.add_argument(
        "--nproc", type=number("nproc"), default=None, help="start N local ranks [default: run in this process]"
    )
    lay.add_argument(
        "--omp-threads",
        type=number("omp-threads"),
        default=0,
        help="OMP_NUM_THREADS per rank [default: cores / ranks, at least 1]",
    )
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


def cmd_export(args, argv) -> int:
    from meshlm.train.export import export, push_to_hub

    out = export(args.checkpoint, args.out, args.trust_remote_code, args.adapter_only)
    print(f"exported {out}")
    if args.push_to_hub:
        print(f"pushed to {push_to_hub(out, args.push_to_hub)}")
    return 0


def cmd_slurm(args, argv) -> int:
    from meshlm.slurm import write_script

    write_script(args, argv)
    return 0


def cmd_verify(args, argv) -> int:
    """Every layout the rank count allows against one process, on the same global batches (see verify.py)."""
    import datetime
    from pathlib import Path

    import torch

    from meshlm import config as config_mod
    from meshlm import verify as v

    overrides = options.overrides(args)
    fixed = [k for k, _ in overrides if k in v.CONTROLLED or k.startswith("parallel.")]
    if fixed:
        raise MeshlmError(f"meshlm verify sets --{fixed[0].replace('_', '-')} itself for every layout; drop it")
    if args.nproc < 1 or args.steps < 1 or args.global_batch < 1:
        raise MeshlmError("--nproc, --steps and --global-batch must be at least 1")
    out = Path(dict(overrides).pop("output_dir", "") or f"outputs/verify-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    named = any(k == "model_name" and val for k, val in overrides)  # its own config: the preset's --arch.* go
    preset = [(k, val) for k, val in config_mod.parse_args(v.PRESETS[args.preset]) if not (named and k[:5] == "arch.")]
    keys = preset + [(k, val) for k, val in overrides if k != "output_dir"]
    cfg = config_mod.load(args.config, keys)
    options.check_inputs(cfg)  # model and data exist: one line now, not one failed run per layout
    base_args = (["--config", args.config] if args.config else []) + config_mod.to_args(keys)
    names = None if args.layouts == "all" else [n.strip() for n in args.layouts.split(",") if n.strip()]
    # LoRA adapters are compared against how far they moved (verify.initial_values), a few updates' size after a
    # few steps, and AdamW's normalised update magnifies reduction-order noise on a gradient element near its eps
    # (docs/lora.md): a looser default there; losses and gradient norms keep their tolerances.
    rtol_params = args.rtol_params if args.rtol_params is not None else (2e-2 if cfg.lora.r else 1e-3)
    tol = {
        "loss": args.rtol_loss,
        "grad_norm": args.rtol_grad_norm,
        "params": rtol_params,
        "rewards": args.rtol_rewards,
    }
    gpus = torch.cuda.device_count() if cfg.backend != "gloo" else 0
    opts = v.Options(base_args, cfg, args.nproc, names, args.steps, args.global_batch, out, args.plot, tol, args.keep)
    return v.verify(opts, gpus)


def cmd_report(args, argv) -> int:
    from pathlib import Path

    from meshlm.report import read_metrics, report, summary

    for line in summary(read_metrics(Path(args.output_dir))):
        print(line)
    for path in report(Path(args.output_dir)):
        print(path)
    return 0


def cmd_env(args, argv) -> int:
    from meshlm.env import report

    print(report())
    return 0


def cmd_plan(args, argv) -> int:
    from meshlm.plan.cli import run

    return run(args)


def _add_verify_options(v: argparse.ArgumentParser) -> None:
    v.add_argument(
        "preset",
        nargs="?",
        default="tiny",
        choices=("tiny", "default"),
        help="built-in model size: tiny (8 layers of 64, seconds per layout) or default (meshlm train's); "
        "--model-name and any other config key override it [default: tiny]",
    )
    v.add_argument("--nproc", type=number("nproc"), default=4, help="ranks for the multi-rank layouts [default: 4]")
    v.add_argument("--layouts", default="all", help="all, or a comma-separated list such as ddp,zero3,tp")
    v.add_argument("--steps", type=number("steps"), default=10, help="optimizer steps per layout [default: 10]")
    v.add_argument(
        "--global-batch",
        type=number("global-batch"),
        default=8,
        help="sequences per optimizer step, split over the data-parallel ranks [default: 8]",
    )
    v.add_argument("--rtol-loss", type=float, default=1e-4, help="max relative loss difference [default: 1e-4]")
    v.add_argument(
        "--rtol-grad-norm", type=float, default=1e-3, help="max relative gradient-norm difference [default: 1e-3]"
    )
    v.add_argument(
        "--rtol-rewards",
        type=float,
        default=1e-4,
        help="--objective dpo: max difference of rewards and log-probabilities, relative to their largest [1e-4]",
    )
    v.add_argument(
        "--rtol-params",
        type=float,
        default=None,
        help="max final parameter difference, ||a-b|| / ||b-b0|| per tensor, b0 its initial value "
        "[default: 1e-3; 2e-2 with --lora.r]",
    )
    v.add_argument("--plot", action="store_true", help="write verify-loss.png (needs matplotlib: meshlm[plot])")
    v.add_argument("--keep", action="store_true", help="keep every layout's run directory, not only those that failed")
    v.add_argument("--config", default=None, help="TOML file of config keys passed to every run")
    add_config_options(v)


def build_parser() -> Parser:
    p = Parser(prog="meshlm", description="Train and run LLMs on 1..N GPUs and nodes with every parallelism.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    p.commands = sub.choices  # name -> the sub-command's parser

    t = sub.add_parser(
        "train",
        help="train a model (the built-in tiny Llama on a synthetic corpus by default)",
        description="Train. Options are config keys; see also --config FILE (TOML).",
    )
    options.add_train_options(t)
    t.set_defaults(func=cmd_train)

    g = sub.add_parser(
        "generate",
        help="batch generation with a KV cache in dp, tp, pp or layer-split mode",
        description="Generate completions for a file of prompts; writes one .jsonl record per "
        "prompt (input order) and a .json metrics summary.",
    )
    _add_generate_options(g)
    g.set_defaults(func=cmd_generate)
    _add_export_parser(sub)

    from meshlm.slurm import add_parser as add_slurm_parser

    add_slurm_parser(sub).set_defaults(func=cmd_slurm)
    _add_plan_verify_report_env(sub)
    return p


def _add_export_parser(sub) -> None:
    x = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (safetensors)",
        description="Consolidate a sharded checkpoint into safetensors + config + tokenizer.",
    )
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
    x.set_defaults(func=cmd_export)


def _add_plan_verify_report_env(sub) -> None:
    from meshlm.plan.cli import add_options as add_plan_options

    pl = sub.add_parser(
        "plan",
        help="which layout fits a model on a cluster, how fast it runs, and its command",
        description="Memory, communication and time of every layout of a model on a cluster; "
        "a recommendation and the command that runs it. --validate checks the model "
        "against real runs on this machine.",
    )
    add_plan_options(pl)
    pl.set_defaults(func=cmd_plan)

    v = sub.add_parser(
        "verify",
        help="train under every layout the rank count allows and compare with one device",
        description="Train the same model on the same global batches under every layout (fp32) and "
        "compare losses, gradient norms and final parameters with the single-process run. "
        "Exit 0 only if every layout that ran is within tolerance.",
    )
    _add_verify_options(v)
    v.set_defaults(func=cmd_verify)

    r = sub.add_parser(
        "report",
        help="plot a run's metrics.jsonl: loss, tokens/s and memory (PNG)",
        description="Turn OUTPUT_DIR/metrics.jsonl into loss.png, tokens_per_s.png and memory.png "
        "in OUTPUT_DIR/plots (needs matplotlib: pip install 'meshlm[plot]').",
    )
    r.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's --output-dir")
    r.set_defaults(func=cmd_report)

    e = sub.add_parser(
        "env",
        help="versions, devices and backends: what a bug report needs",
        description="Print the versions of meshlm and the packages it uses, the devices and process group "
        "backends this machine has, and the torchrun it would use: paste it into a bug report.",
    )
    e.set_defaults(func=cmd_env)


def main(argv: list[str] | None = None) -> None:
    status = run(list(sys.argv[1:] if argv is None else argv))
    runtime = sys.modules.get("meshlm.runtime")
    if runtime is not None and runtime.was_distributed:
        runtime.leave_rank(int(status or 0))  # a finished rank: no C++ teardown that could still abort it
    sys.exit(status)


def rank_main(command: str, argv: list[str]) -> None:
    """`meshlm <command> <argv>` as one rank of meshlm's launcher, forked from its fork server (launch.py).

    A rank that succeeds returns (torchelastic waits for every rank's return value); one that fails leaves with
    its status at once, as `python -m meshlm` would (runtime.leave_rank: no teardown that could still abort it)."""
    from meshlm.launch import become_rank

    become_rank()
    status = run([command, *argv])
    if status:
        from meshlm.runtime import leave_rank

        leave_rank(int(status))


def run(argv: list[str]) -> int:
    """`meshlm ARGV` in this process: its exit status (a MeshlmError: its one line, EXIT_USAGE)."""
    launched = bool(os.environ.get("MESHLM_LAUNCHED"))
    # Under the launcher every rank's stderr goes to a file and the launcher shows one copy;
    # under plain torchrun only rank 0 speaks, so the console gets one line, not N.
    speaks = launched or os.environ.get("RANK", "0") == "0"
    try:
        return _run(argv)
    except MeshlmError as e:
        if speaks:
            print(f"meshlm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # Interrupted: stopped between two steps; otherwise Ctrl-C anywhere else
        if speaks and not launched:  # the launcher says it once for all ranks
            print(f"meshlm: {str(e) or 'interrupted (SIGINT)'}", file=sys.stderr)  # Ctrl-C's own has no text
        return 128 + getattr(e, "signum", signal.SIGINT)


def _run(argv: list[str]) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise MeshlmError(_unknown_options(parser, args.command, unknown))
    if args.command != "env":  # env reports the versions, whatever they are
        from meshlm import versions

        versions.check()
    return args.func(args, argv[1:])


def _unknown_options(parser: Parser, command: str, unknown: list[str]) -> str:
    """The unrecognised options, the closest option of the sub-command to the first, and where its help is."""
    import difflib

    sub = parser.commands[command]
    known = [o for action in sub._actions for o in action.option_strings if o.startswith("--")]
    first = next((u.split("=", 1)[0] for u in unknown if u.startswith("-")), "")
    close = difflib.get_close_matches(first, known, n=1, cutoff=0.6) if first else []
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint} (see `meshlm {command} --help`)"
