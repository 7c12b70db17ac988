"""`meshlm train`: in this process (or as one rank of torchrun's), or `--nproc N` ranks through launch.py."""

from __future__ import annotations

import os

from meshlm import options
from meshlm.errors import MeshlmError

DESCRIPTION = "Train. Options are config keys; see also --config FILE (TOML)."
add_options = options.add_train_options


def run(args, argv: list[str]) -> int:
    from meshlm import config as config_mod

    cfg = config_mod.load(args.config, options.overrides(args))
    options.choose_gpus(args.gpus, args.nproc)
    if args.nproc is not None:
        return _launch_train(cfg, args)
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


TRAIN = "meshlm.train.trainer:train"  # what each rank of the launcher runs, given the job's Config


def _launch_train(cfg, args) -> int:
    """Validate what can be validated here (data included: its cache is filled now, the ranks map it), hold the
    run directory, then start the ranks, each training the same Config."""
    import contextlib
    import copy

    from meshlm import runtime
    from meshlm.checkpoint.run_dir import RunLock, takes_lock
    from meshlm.launch import LaunchOptions, check, launch

    job = copy.deepcopy(cfg)  # the ranks' config as parsed: the checks below resolve fields of cfg in place
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
        return launch(TRAIN, (job,), opts, cfg.out, stop_timeout_s=cfg.dist_timeout + 30)
