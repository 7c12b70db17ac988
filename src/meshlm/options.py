"""The `meshlm train` command line: config keys as options, the launch flags and their stripping, and the
checks of a job before any rank starts. `meshlm train --nproc`, `meshlm slurm` and `meshlm verify`
read it; none of them needs the others."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshlm.errors import MeshlmError


class HelpFormatter(argparse.HelpFormatter):
    """Every sub-command's help in one style: an option's default, when it has one, ends its help as
    `[default: X]` (options whose default is best said in words write that themselves, in the same brackets)."""

    def _get_help_string(self, action):
        text = action.help or ""
        quiet = (None, "", False, argparse.SUPPRESS)
        if "[default:" in text or action.default in quiet or not action.option_strings:
            return text
        return f"{text} [default: %(default)s]"


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one `meshlm: error: ...` line (exit 2), without the usage block, and
    takes no prefix of an option for the option."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # options are config keys: --max-step must not mean --max-steps
        super().__init__(*args, **kwargs)

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
    from meshlm.config import flat_keys

    g = p.add_argument_group("config keys (also settable in a TOML file given by --config)")
    for key in flat_keys():
        add_config_option(g, key)


def add_config_option(g, key: str, help: str | None = None) -> None:
    """One config key as an option (with its aliases), its value kept as given for config.set_key; `help`
    replaces the field's own (argparse.SUPPRESS hides it): `meshlm plan` takes train's keys this way."""
    from meshlm.config import ALIASES, flat_keys

    typ, f = flat_keys()[key]
    opts = ["--" + k.replace("_", "-") for k in (key, *(a for a, to in ALIASES.items() if to == key))]
    if help is None:
        help = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            help += f" {{{', '.join(choices)}}}"
        default = f.default if f.default is not f.default_factory else None
        help += f" [default: {str(default).lower() if typ is bool else default}]" if default not in ("", None) else ""
    if typ is bool:
        g.add_argument(*opts, dest=key, nargs="?", const="true", default=argparse.SUPPRESS, metavar="BOOL", help=help)
    else:
        g.add_argument(*opts, dest=key, default=argparse.SUPPRESS, metavar=typ.__name__.upper(), help=help)


def overrides(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """The config keys given on the command line, as (key, value) for config.load."""
    from meshlm.config import flat_keys

    keys = flat_keys()
    return [(k, v) for k, v in vars(ns).items() if k in keys]


def add_launch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (torchrun underneath)")
    add_nproc_option(g)
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
        "[default: with --nnodes > 1, one derived from the --rdzv-endpoint port, the same on every node]",
    )
    g.add_argument(
        "--rdzv-timeout",
        type=number("rdzv-timeout"),
        default=600,
        help="seconds for all --nnodes to join; then fail, naming the nodes that did not",
    )
    g.add_argument(
        "--max-restarts",
        type=number("max-restarts"),
        default=0,
        help="restart all ranks up to K times when one fails; training resumes from checkpoints/latest",
    )
    add_omp_threads_option(g)
    add_gpus_option(g)


def add_nproc_option(g) -> None:
    """--nproc, as every command that starts local ranks through launch.py takes it."""
    g.add_argument(
        "--nproc", type=number("nproc"), default=None, help="start N local ranks [default: run in this process]"
    )


def add_omp_threads_option(g) -> None:
    g.add_argument(
        "--omp-threads",
        type=number("omp-threads"),
        default=0,
        help="OMP_NUM_THREADS per rank [default: cores / ranks, at least 1]",
    )


GPUS_HELP = (
    "GPUs to run on, by index as nvidia-smi numbers them (of those CUDA_VISIBLE_DEVICES shows, when set), "
    "one per rank, e.g. 0,1 with --nproc 2: sets CUDA_VISIBLE_DEVICES for the ranks"
)


def add_gpus_option(g) -> None:
    g.add_argument("--gpus", default="", metavar="I,J,...", help=GPUS_HELP)


def visible_gpus(spec: str, nproc: int | None, visible: list[str]) -> str:
    """The CUDA_VISIBLE_DEVICES value that --gpus `spec` gives the ranks: its indices into `visible` (the GPUs this
    process sees: CUDA_VISIBLE_DEVICES's entries, else 0..count-1), one per rank; one line for anything else."""
    items = [s.strip() for s in spec.split(",")]
    if not all(i.isdigit() for i in items):
        raise MeshlmError(f"--gpus needs GPU indices separated by commas, e.g. 0,1; got {spec!r}")
    if not visible:
        raise MeshlmError(f"--gpus {spec} chooses GPUs, and no CUDA GPU is visible here (CPU ranks); drop --gpus")
    indices = [int(i) for i in items]
    if len(set(indices)) < len(indices):
        raise MeshlmError(f"--gpus {spec} names a GPU twice; give each rank its own GPU")
    wrong = [i for i in indices if i >= len(visible)]
    if wrong:
        raise MeshlmError(
            f"--gpus {spec}: GPU {wrong[0]} is not there; this machine shows {len(visible)} GPU(s), "
            f"0 to {len(visible) - 1}"
        )
    ranks = nproc or 1
    if len(indices) != ranks:
        fix = f"--nproc {len(indices)}" if nproc else f"add --nproc {len(indices)}"
        raise MeshlmError(f"--gpus {spec} names {len(indices)} GPU(s) for {ranks} rank(s): one per rank; {fix}")
    return ",".join(visible[i] for i in indices)


def choose_gpus(spec: str, nproc: int | None) -> None:
    """--gpus: set CUDA_VISIBLE_DEVICES for this process and the ranks it starts, before anything asks CUDA."""
    import os

    if not spec:
        return
    import torch

    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    if shown is not None:
        visible = [v.strip() for v in shown.split(",") if v.strip()]
        visible = visible if torch.cuda.is_available() else []
    else:
        visible = [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus(spec, nproc, visible)


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


def launch_flags() -> set[str]:
    """The options add_launch_options declares (--gpus among them: the ranks get CUDA_VISIBLE_DEVICES instead)."""
    p = argparse.ArgumentParser(add_help=False)
    add_launch_options(p)
    return {o for action in p._actions for o in action.option_strings}


def strip_launch_flags(argv: list[str]) -> list[str]:
    """argv without the launch flags (and their values): what each rank runs."""
    flags = launch_flags()
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def launch_flags_in(argv: list[str]) -> list[str]:
    flags = launch_flags()
    return sorted(a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in flags)


def check_inputs(cfg) -> None:
    """Model and data exist (one line now, not a failure on every rank)."""
    from meshlm.data.load import dataset_source

    dataset_source(cfg)
    if cfg.model_name:  # transformers' config classes cost the launcher ~3 CPU s: only for a named model
        import torch

        from meshlm.models.attention import implementation
        from meshlm.models.build import model_config

        implementation(cfg.attention, model_config(cfg), torch.cuda.is_available(), cfg.seq_length)
        if cfg.pretrained and Path(cfg.model_name).is_dir():
            from meshlm.models.safetensors_read import SafetensorsCheckpoint

            SafetensorsCheckpoint(cfg.model_name)  # every weight file there, none cut short (headers only)


def check_devices(cfg, gpus_wanted: int = 0) -> None:
    """Enough GPUs for the ranks, and options that need GPUs only where there are some."""
    import torch

    cuda = cfg.backend == "nccl" or (cfg.backend == "auto" and torch.cuda.is_available())
    if cuda and gpus_wanted > torch.cuda.device_count():
        raise MeshlmError(
            f"--nproc {gpus_wanted} is more than the {torch.cuda.device_count()} visible GPU(s); "
            f"lower --nproc or use --backend gloo for CPU ranks"
        )
    if cfg.cpu_offload and not cuda:
        raise MeshlmError(
            "--cpu-offload moves GPU state to the CPU: it needs CUDA GPUs, and this run is on CPU; drop --cpu-offload"
        )
    if cfg.float8 != "off" and not cuda:  # on GPUs each rank checks its compute capability (parallel/apply.py)
        from meshlm.parallel import float8

        float8.check(cfg.float8, torch.device("cpu"), cfg.parallel.sequence_parallel)


def check_data(cfg, layout) -> None:
    """Read, tokenise and pack the dataset now (into the cache the ranks then map) and check that it holds a
    global batch (of these ranks, kept from a resumed run): a bad record or a dataset too small is one line
    before any rank starts. Data an earlier run packed with the built-in tokenizer was checked then: only its
    size is read (transformers, which building a tokenizer imports, costs the launcher ~1 CPU s)."""
    from meshlm.checkpoint import continuity, run_dir
    from meshlm.data.load import cached_blocks, check_enough_blocks, load_data

    continuity.keep_global_batch(cfg, layout.dp, run_dir.resumed(cfg))  # a global batch these ranks cannot hold
    if cfg.objective == "grpo":  # prompts and reward functions, as the ranks will read them
        from meshlm.objectives.grpo_data import check_prompts

        return check_prompts(cfg)
    blocks = cached_blocks(cfg)
    if blocks is None:
        from meshlm.models.build import check_seq_length, load_tokenizer, model_config

        tokenizer, tokenizer_id = load_tokenizer(cfg)
        if cfg.model_name:  # its config is read already (check_inputs); the built-in model's, by the ranks
            check_seq_length(cfg, model_config(cfg, len(tokenizer)))
        blocks = len(load_data(cfg, tokenizer, tokenizer_id)[0])
    check_enough_blocks(cfg, blocks, cfg.global_batch_size)


def check_job(cfg, world: int, gpus_wanted: int = 0, data: bool = False, node_rank: int = 0):
    """What can be checked before any rank starts: enough GPUs, the layout for `world` ranks, dataset and
    model exist (with data=True: the dataset's records too), the run directory may be written. Returns the
    resolved layout."""
    from meshlm.checkpoint import run_dir
    from meshlm.layout import resolve

    if gpus_wanted:  # not for `meshlm slurm`, which writes a script on a machine without the job's GPUs
        check_devices(cfg, gpus_wanted)
    run_dir.check(cfg, node_rank)
    layout = resolve(cfg, world)
    check_inputs(cfg)
    if data:
        check_data(cfg, layout)
    return layout
