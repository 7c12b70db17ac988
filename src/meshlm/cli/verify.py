"""`meshlm verify`: every layout the rank count allows against one process (verify.py does the work)."""

from __future__ import annotations

import argparse

from meshlm import options
from meshlm.errors import MeshlmError
from meshlm.options import add_config_options, number

DESCRIPTION = (
    "Train the same model on the same global batches under every layout (fp32) and "
    "compare losses, gradient norms and final parameters with the single-process run. "
    "Exit 0 only if every layout that ran is within tolerance."
)


def add_options(v: argparse.ArgumentParser) -> None:
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


def run(args, argv) -> int:
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
