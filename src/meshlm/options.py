"""The `meshlm train` command line: config keys as options, the launch flags and their stripping, and the
checks of a job before any rank starts. `meshlm train --nproc`, `meshlm slurm` and `meshlm verify`
read it; none of them needs the others."""

from __future__ import annotations

import argparse

from meshlm.errors import MeshlmError

LAUNCH_FLAGS = {
    "--nproc",
    "--nnodes",
    "--node-rank",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-timeout",
    "--max-restarts",
    "--omp-threads",
}


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one `meshlm: error: ...` line (exit 2), without the usage block."""

    def error(self, message: str):
        raise MeshlmError(f"{message} (see `{self.prog} --help`)")


def number(name: str, kind: type = int):
    """An argparse type: an int (or a float with kind=float), or a one-line error naming the option."""

    def parse(s):
        try:
            return kind(s)
        except ValueError:
            raise MeshlmError(f"--{name} needs {'an integer' if kind is int else 'a number'}, got {s!r}") from None

    return parse


def add_config_options(p: argparse.ArgumentParser) -> None:
    from meshlm.config import ALIASES, flat_keys

    g = p.add_argument_group("config keys (also settable in a TOML file given by --config)")
    for key, (typ, f) in flat_keys().items():
        opts = ["--" + k.replace("_", "-") for k in (key, *(a for a, to in ALIASES.items() if to == key))]
        help = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            help += f" {{{', '.join(choices)}}}"
        default = f.default if f.default is not f.default_factory else None
        help += f" [default: {default!r}]" if default not in ("", None) else ""
        if typ is bool:
            g.add_argument(
                *opts, dest=key, nargs="?", const="true", default=argparse.SUPPRESS, metavar="BOOL", help=help
            )
        else:
            g.add_argument(*opts, dest=key, default=argparse.SUPPRESS, metavar=typ.__name__.upper(), help=help)


def overrides(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """The config keys given on the command line, as (key, value) for config.load."""
    from meshlm.config import flat_keys

    keys = flat_keys()
    return [(k, v) for k, v in vars(ns).items() if k in keys]


def add_launch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (torchrun underneath)")
    g.add_argument(
        "--nproc", type=number("nproc"), default=0, help="start N local ranks (default: run in this process)"
    )
    g.add_argument("--nnodes", type=number("nnodes"), default=1, help="number of nodes (one launcher per node)")
    g.add_argument(
        "--node-rank",
        type=number("node-rank"),
        default=0,
        help="this node's rank among --nnodes; node 0 hosts the rendezvous at --rdzv-endpoint",
    )
    g.add_argument(
        "--rdzv-endpoint",
        default="",
        help="HOST:PORT of the c10d rendezvous for multi-node jobs (it listens on HOST only)",
    )
    g.add_argument(
        "--rdzv-id",
        default="",
        help="job id shared by all nodes' launchers "
        "(default with --nnodes > 1: one derived from the --rdzv-endpoint port, the same on every node)",
    )
    g.add_argument(
        "--rdzv-timeout",
        type=number("rdzv-timeout"),
        default=600,
        help="seconds for all --nnodes to join; then fail, naming the nodes that did not [default: 600]",
    )
    g.add_argument(
        "--max-restarts",
        type=number("max-restarts"),
        default=0,
        help="restart all ranks up to K times when one fails; training resumes from checkpoints/latest",
    )
    g.add_argument(
        "--omp-threads",
        type=number("omp-threads"),
        default=0,
        help="OMP_NUM_THREADS per rank (default: cores / ranks, at least 1)",
    )


def add_train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML file of config keys (command-line options override it)")
    add_launch_options(p)
    add_config_options(p)


def parse_train(argv: list[str]):
    """`meshlm train ARGV` parsed and its config loaded: (namespace, config)."""
    from meshlm import config

    p = Parser(prog="meshlm train")
    add_train_options(p)
    ns = p.parse_args(argv)
    return ns, config.load(ns.config, overrides(ns))


def strip_launch_flags(argv: list[str]) -> list[str]:
    """argv without the launch flags (and their values): what each rank runs."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def launch_flags_in(argv: list[str]) -> list[str]:
    return sorted(a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in LAUNCH_FLAGS)


def check_inputs(cfg) -> None:
    """Model and data exist (one line now, not a failure on every rank)."""
    from meshlm.data.load import dataset_source

    dataset_source(cfg)
    if cfg.model_name:  # transformers' config classes cost the launcher ~3 CPU s: only for a named model
        from meshlm.models.build import model_config

        model_config(cfg)


def check_job(cfg, world: int, gpus_wanted: int = 0):
    """What can be checked before any rank starts: enough GPUs, the layout for `world` ranks, dataset and
    model exist. Returns the resolved layout."""
    import torch

    from meshlm.layout import resolve

    wants_gpu = cfg.backend == "nccl" or (cfg.backend == "auto" and torch.cuda.is_available())
    if wants_gpu and gpus_wanted > torch.cuda.device_count():
        raise MeshlmError(
            f"--nproc {gpus_wanted} is more than the {torch.cuda.device_count()} visible GPU(s); "
            f"lower --nproc or use --backend gloo for CPU ranks"
        )
    layout = resolve(cfg, world)
    check_inputs(cfg)
    return layout
