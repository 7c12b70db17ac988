"""`meshlm slurm`: write an sbatch script that runs `meshlm train` on N nodes of a Slurm allocation.

The script starts one meshlm launcher per node with srun (one task per node, all
its GPUs); the launchers meet at a c10d rendezvous on the first node of the
allocation, by IP address, so nothing depends on how hostnames resolve. Each
node's launcher output and errors go to its own files under
<output-dir>/logs/slurm-<jobid>/, next to the ranks' logs. The training
arguments are checked now (a typo should not wait hours in the queue) and then
passed through unchanged, quoted for the shell.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from meshlm.errors import MeshlmError

TEMPLATE = """\
#!/bin/bash
# Written by `{command}`.
# Submit with: sbatch {script}
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --time={time}
#SBATCH --chdir={chdir}
#SBATCH --output=slurm-%j.out
# Two minutes before the time limit every rank gets SIGINT: they stop after the same step and save a checkpoint
# (--ckpt-on-signal-after), which a resubmitted job resumes from.
#SBATCH --signal=INT@120
{extra}set -euo pipefail

# The rendezvous listens on the first node of the allocation, on its IP address.
# sed reads all of scontrol's output (head would close the pipe early: SIGPIPE, a failure under pipefail)
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
head_addr=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{{print $1}}')
rdzv_port={port}

# One directory per job: node-<N>.out / node-<N>.err for each node's launcher (N = node index).
log_dir={log_dir}/slurm-$SLURM_JOB_ID
mkdir -p "$log_dir"
echo "meshlm: {nodes} nodes x {gpus} GPUs, rendezvous $head_addr:$rdzv_port, node logs in $log_dir"

python=${{MESHLM_PYTHON:-{python}}}
# One task per node holding all of the node's CPUs (srun does not inherit them from sbatch since Slurm 22.05).
srun --nodes={nodes} --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 \\
    --output="$log_dir/node-%n.out" --error="$log_dir/node-%n.err" \\
    bash -c 'exec "$0" -m meshlm train --nnodes {nodes} --nproc {gpus} --node-rank "$SLURM_NODEID" \\
        --rdzv-endpoint "$1:$2" --rdzv-id "meshlm-$SLURM_JOB_ID" --max-restarts {max_restarts} "${{@:3}}"' \\
    "$python" "$head_addr" "$rdzv_port" \\
    {train_args}
"""

TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")  # Slurm's formats: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def add_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--nodes", type=int, required=True, help="number of nodes")
    s.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (= ranks) per node")
    s.add_argument("--time", required=True, help="wall-clock limit, e.g. 04:00:00 or 1-00:00:00")
    s.add_argument("--partition", default="", help="Slurm partition")
    s.add_argument("--account", default="", help="Slurm account to charge")
    s.add_argument("--job-name", default="meshlm", help="Slurm job name")
    s.add_argument("--port", type=int, default=29400, help="rendezvous port on the first node")
    s.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restart all ranks up to K times when one fails (resuming from checkpoints/latest)",
    )
    s.add_argument("--script", default="", help="where to write the script (- for stdout) [default: <job-name>.sbatch]")
    s.add_argument("train", nargs=argparse.REMAINDER, help="-- train ARGS...: the training command, unchanged")


def _train_args(rest: list[str]) -> list[str]:
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if rest[:1] != ["train"]:
        raise MeshlmError(
            "meshlm slurm needs the training command after --, e.g. `meshlm slurm --nodes 2 "
            "--gpus-per-node 8 --time 01:00:00 -- train --max-steps 1000`"
        )
    return rest[1:]


def render(args, argv: list[str]) -> str:
    """The sbatch script for the parsed `meshlm slurm` arguments (argv: as typed after `slurm`)."""
    from meshlm import options

    train = _train_args(args.train)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise MeshlmError("--nodes and --gpus-per-node must be at least 1")
    if not TIME.match(args.time):
        raise MeshlmError(f"--time must be a Slurm time such as 04:00:00 or 1-00:00:00, got {args.time!r}")
    if not 0 < args.port < 65536 or args.max_restarts < 0:
        raise MeshlmError("--port must be in 1..65535 and --max-restarts must not be negative")
    for value, flag in ((args.job_name, "--job-name"), (args.partition, "--partition"), (args.account, "--account")):
        if value and not NAME.match(value):
            raise MeshlmError(f"{flag} may hold letters, digits, '_', '-' and '.', got {value!r}")
    set_by_us = options.launch_flags_in(train)
    if set_by_us:
        raise MeshlmError(
            f"{', '.join(set_by_us)} in the training arguments: meshlm slurm sets the launch "
            f"options itself (use --nodes, --gpus-per-node, --max-restarts)"
        )
    _, cfg = options.parse_train(train)  # the checks `meshlm train --nproc` makes first
    options.check_job(cfg, args.nodes * args.gpus_per_node)
    script = args.script or f"{args.job_name}.sbatch"
    extra = "".join(f"#SBATCH --{k}={v}\n" for k, v in (("partition", args.partition), ("account", args.account)) if v)
    return TEMPLATE.format(
        command=shlex.join(["meshlm", "slurm", *argv]).replace("\n", " "),
        script=shlex.quote(script) if script != "-" else "FILE",
        job_name=args.job_name,
        nodes=args.nodes,
        gpus=args.gpus_per_node,
        time=args.time,
        chdir=shlex.quote(str(Path.cwd())),
        extra=extra,
        port=args.port,
        log_dir=shlex.quote(str(cfg.out / "logs")),
        python=shlex.quote(sys.executable),
        max_restarts=args.max_restarts,
        train_args=" ".join(shlex.quote(a) for a in train),
    )


def write_script(args, argv: list[str]) -> None:
    text = render(args, argv)
    if args.script == "-":
        sys.stdout.write(text)
        return
    path = Path(args.script or f"{args.job_name}.sbatch")
    try:
        path.write_text(text)
    except OSError as e:
        raise MeshlmError(f"could not write {path}: {e.strerror}") from None
    path.chmod(0o755)
    print(f"wrote {path} ({args.nodes} nodes x {args.gpus_per_node} GPUs); submit it with: sbatch {path}")
