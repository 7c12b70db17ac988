"""`meshlm COMMAND ...`: one module per command (meshlm/cli/COMMAND.py: its description, options and run), imported
only when that command runs, so `meshlm train` builds its own parser and imports nothing of the others. A rank
of meshlm's launcher starts in runtime.run_rank, not here: a training rank parses nothing."""

from __future__ import annotations

import importlib
import os
import sys

from meshlm.errors import MeshlmError, exit_status
from meshlm.options import Parser

# name -> the one line `meshlm --help` shows for it, in its order: a static list, so listing the commands
# imports none of them
COMMANDS = {
    "train": "train a model (the built-in tiny Llama on a synthetic corpus by default)",
    "generate": "batch generation with a KV cache in dp, tp, pp or layer-split mode",
    "export": "write a checkpoint as a Hugging Face model directory (safetensors)",
    "slurm": "write an sbatch script that runs `meshlm train` on N nodes",
    "plan": "which layout fits a model on a cluster, how fast it runs, and its command",
    "verify": "train under every layout the rank count allows and compare with one device",
    "report": "plot a run's metrics.jsonl: loss, tokens/s and memory (PNG)",
    "env": "versions, devices and backends: what a bug report needs",
}
DESCRIPTION = "Train and run LLMs on 1..N GPUs and nodes with every parallelism."


def command(name: str):
    """The module of command `name` (meshlm/cli/NAME.py): DESCRIPTION, add_options(parser), run(args, argv)."""
    return importlib.import_module(f"{__name__}.{name}")


def _top_parser(with_options: bool) -> Parser:
    """`meshlm`'s parser: every command listed; each command's own options only with with_options (tests and
    the help-style rule read them all), else a command is a bare name for --help and the usage errors."""
    p = Parser(prog="meshlm", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    p.commands = sub.choices  # name -> the sub-command's parser
    for name, help in COMMANDS.items():
        if with_options:
            module = command(name)
            module.add_options(sub.add_parser(name, help=help, description=module.DESCRIPTION))
        else:
            sub.add_parser(name, help=help)
    return p


def build_parser() -> Parser:
    """Every command's parser under `meshlm` (what `meshlm COMMAND` builds for its one command)."""
    return _top_parser(with_options=True)


def command_parser(name: str) -> Parser:
    """`meshlm NAME`'s parser alone, as build_parser makes it."""
    module = command(name)
    p = Parser(prog=f"meshlm {name}", description=module.DESCRIPTION)
    module.add_options(p)
    return p


def main(argv: list[str] | None = None) -> None:
    status = run(list(sys.argv[1:] if argv is None else argv))
    runtime = sys.modules.get("meshlm.runtime")
    if runtime is not None and runtime.was_distributed:
        runtime.leave_rank(int(status or 0))  # a finished rank: no C++ teardown that could still abort it
    sys.exit(status)


def run(argv: list[str]) -> int:
    """`meshlm ARGV` in this process: its exit status (a MeshlmError: its one line, EXIT_USAGE)."""
    return exit_status(_run, argv)


def _run(argv: list[str]) -> int:
    before: list[str] = []
    if not argv or argv[0] not in COMMANDS:  # --help, a missing or unknown command, options before it
        name = _top_parser(with_options=False).parse_known_args(argv)[0].command
        before = argv[: argv.index(name)]
        argv = argv[len(before) :]
    name = argv[0]
    parser = command_parser(name)
    args, unknown = parser.parse_known_args(argv[1:])
    args.command = name
    if before or unknown:
        raise MeshlmError(_unknown_options(parser, name, before + unknown))
    # env reports the versions, whatever they are; a rank of meshlm's launcher runs the interpreter and packages
    # its launcher checked
    if name != "env" and not os.environ.get("MESHLM_LAUNCHED"):
        from meshlm import versions

        versions.check()
    return command(name).run(args, argv[1:])


def _unknown_options(sub: Parser, command: str, unknown: list[str]) -> str:
    """The unrecognised options, the closest option of the sub-command to the first, and where its help is."""
    import difflib

    known = [o for action in sub._actions for o in action.option_strings if o.startswith("--")]
    first = next((u.split("=", 1)[0] for u in unknown if u.startswith("-")), "")
    close = difflib.get_close_matches(first, known, n=1, cutoff=0.6) if first else []
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint} (see `meshlm {command} --help`)"
