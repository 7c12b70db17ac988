"""`meshlm slurm`: an sbatch script that runs `meshlm train` on N nodes (slurm.py does the work)."""

from __future__ import annotations

DESCRIPTION = (
    "Write an sbatch script for `meshlm train ARGS` on a Slurm cluster. "
    "Usage: meshlm slurm --nodes 4 --gpus-per-node 8 --time 04:00:00 -- train ARGS..."
)


def add_options(p) -> None:
    from meshlm.slurm import add_options as add_slurm_options

    add_slurm_options(p)


def run(args, argv) -> int:
    from meshlm.slurm import write_script

    write_script(args, argv)
    return 0
