"""Many meshlm runs in one launch: each case of a list (a model family under a layout) goes through meshlm's
real trainer or generator in the ranks of one job. A family matrix then pays one process start-up per world
size (about 10 s on 2 cores), not one per run. Used by tests/test_families.py and benchmarks/families.py.

    python tests/helpers/family_runs.py --nproc 2 CASES.json OUT.json   (2 ranks forked from one process)
    python tests/helpers/family_runs.py CASES.json OUT.json             (one process: the references)

With --nproc the ranks are forked from a fork server that imported meshlm's trainer once, as `meshlm train`'s
launcher forks its own (launch.py): each rank of `torch.distributed.run` imported torch and transformers again,
about 5 CPU seconds a rank. (Under torchrun, without --nproc, the script runs as one of its ranks.)

CASES.json is {"setup": [python files to run first], "cases": [{"id", "kind", "args"}]}: a setup file may register
a model family (transformers' Auto classes and meshlm's registry) in every rank. Kinds: "train" (args: `meshlm
train` options; with "logits": token ids, it also records the trained model's logits on them, for a layout
without a pipeline; with "console": true, what rank 0 printed), "generate" (args: GenerateOptions fields,
"sampling" a dict of Sampling's), "copy_checkpoint" (args {"src", "step", "dst"}: `dst` becomes a run directory
whose latest checkpoint is a copy of run `src`'s step, for a later case to resume under another layout) and
"transformers_tp".
OUT.json maps each id to what rank 0 saw: losses and grad norms per step, logits, generated token ids, or the
one-line error.
"""

from __future__ import annotations

import io
import json
import logging
import os
import runpy
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
# How launch() starts `python family_runs.py ...`: subprocess.run's signature and result. The tests' conftest
# sets its run_python, which forks it from a process that has imported meshlm; benchmarks start a new one.
START = subprocess.run


def launch(world: int, spec: dict, workdir: Path, timeout: float = 1200) -> dict:
    """Run `spec` (see the module docstring) on `world` ranks (one plain process for 1); the results by case id."""
    workdir.mkdir(parents=True, exist_ok=True)
    cases, out = workdir / f"cases-{world}.json", workdir / f"results-{world}.json"
    cases.write_text(json.dumps(spec))
    for stale in out.parent.glob(f"{out.name}.rank*"):
        stale.unlink()
    ranks = ["--nproc", str(world)] if world > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(HERE), *ranks, str(cases), str(out)]
    p = START(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"family_runs on {world} ranks exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    results = json.loads(out.read_text())
    for other in sorted(out.parent.glob(f"{out.name}.rank*")):
        for case, r in json.loads(other.read_text()).items():
            if broken(results.get(case, {})) and not broken(r):  # the cause, not rank 0's timeout
                results[case] = {"error": f"{other.name.rpartition('.')[2]}: {r['error']}"}
        other.unlink()
    return results


BROKEN = ("Connection closed", "Timed out", "timed out", "pair closure", "Application timeout")


def broken(result: dict) -> bool:
    """A case's error is the process group breaking (a collective timed out, a peer gone), not its own."""
    return any(text in result.get("error", "") for text in BROKEN)


def train_case(case: dict, rt) -> dict:
    from meshlm import runtime
    from meshlm.config import load, parse_args
    from meshlm.train.trainer import Trainer

    cfg = load(None, parse_args(case["args"]))
    console = io.StringIO()  # with "console": what rank 0 printed, set-up lines included (the run's log starts later)
    if case.get("console"):
        runtime.log.addHandler(logging.StreamHandler(console))
    trainer = Trainer(cfg, rt)
    trainer.run()
    result = {"console": console.getvalue()} if case.get("console") and rt.is_main else {}
    if rt.is_main:
        rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
        result |= {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows]}
        if "aux_loss" in rows[0]:  # a mixture of experts: its router loss and tokens per expert (parallel/aux_loss.py)
            result |= {"aux_losses": [r["aux_loss"] for r in rows], "router_tokens": [r["router_tokens"] for r in rows]}
            result |= {k: rows[-1][k] for k in ("expert_state_bytes", "all_to_all_s")}  # the largest rank's; rank 0's
        result |= {k: rows[-1][k] for k in ("adapter_bytes", "grad_bytes", "optim_bytes") if k in rows[-1]}  # LoRA
    if case.get("logits"):
        ids = torch.tensor(case["logits"], device=rt.device)
        with torch.no_grad():
            out = trainer.engine.model(input_ids=ids, use_cache=False).logits
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        result["logits"] = out.tolist() if rt.is_main else None
    return result


def generate_case(case: dict, rt) -> dict:
    from meshlm.infer.decode import Sampling
    from meshlm.infer.generate import GenerateOptions, generate
    from meshlm.infer.load import ModelChoice

    a = dict(case["args"])
    opts = GenerateOptions(
        prompts=a["prompts"],
        out=a["out"],
        mode=a["mode"],
        devices=a.get("devices", ""),
        model=ModelChoice(a.get("model_name", ""), a.get("checkpoint", "")),
        max_new_tokens=a["max_new_tokens"],
        batch_size=a.get("batch_size", 8),
        sampling=Sampling(**a.get("sampling", {})),
        overwrite=True,
    )
    generate(opts, rt)
    if not rt.is_main:
        return {}
    rows = [json.loads(line) for line in Path(opts.out).read_text().splitlines()]
    return {"tokens": [r["token_ids"] for r in rows]}


def copy_checkpoint_case(case: dict, rt) -> dict:
    from meshlm import runtime

    if rt.is_main:
        src, step, dst = Path(case["args"]["src"]), case["args"]["step"], Path(case["args"]["dst"])
        shutil.copytree(src / "checkpoints" / f"step-{step}", dst / "checkpoints" / f"step-{step}")
        (dst / "checkpoints" / "latest").write_text(f"step-{step}\n")
    runtime.barrier()
    return {}


def transformers_tp_case(case: dict, rt) -> dict:
    """transformers' own tensor parallel (from_pretrained with tp_plan="auto") against its one-process logits."""
    from transformers import AutoModelForCausalLM

    a = case["args"]
    ids = torch.tensor(a["ids"])
    whole = AutoModelForCausalLM.from_pretrained(a["model_name"], dtype=torch.float32).eval()
    split = AutoModelForCausalLM.from_pretrained(a["model_name"], dtype=torch.float32, tp_plan="auto").eval()
    with torch.no_grad():
        want, got = whole(input_ids=ids).logits, split(input_ids=ids).logits
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    return {"max_diff": (got - want).abs().max().item()}


KINDS = {
    "train": train_case,
    "generate": generate_case,
    "copy_checkpoint": copy_checkpoint_case,
    "transformers_tp": transformers_tp_case,
}


def _why(e: BaseException) -> str:
    """The error's first line, and its cause's where it only wraps one (a pipeline stage's "failed to run
    forward")."""
    lines = str(e).strip().splitlines() or [""]
    text = f"{type(e).__name__}: {lines[0][:300]}"
    return f"{text} {_why(e.__cause__)}" if e.__cause__ is not None and text.endswith(":") else text


def main(cases_path: str, out_path: str) -> None:
    from meshlm import runtime

    rt = runtime.init("gloo", timeout_s=120.0, want_cuda=False)
    runtime.setup_logging(rt)
    spec = json.loads(Path(cases_path).read_text())
    for path in spec.get("setup", []):
        runpy.run_path(path)
    results = {}
    for case in spec["cases"]:
        for handler in runtime.log.handlers:  # the last run's logs/rank-N.log: each run's file holds its own lines
            handler.close()
        runtime.setup_logging(rt)
        try:
            results[case["id"]] = KINDS[case["kind"]](case, rt)
        except Exception as e:  # the row says why; the next case still runs (a symmetric failure: every rank)
            results[case["id"]] = {"error": _why(e)}
            if not rt.is_main:
                continue
            traceback.print_exc(file=sys.stderr)
    if rt.is_main:
        Path(out_path).write_text(json.dumps(results))
    else:  # a case that failed on this rank only left rank 0 waiting in a collective: launch() reads why
        errors = {k: r for k, r in results.items() if "error" in r}
        Path(f"{out_path}.rank{rt.rank}").write_text(json.dumps(errors))
    runtime.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_thread() -> bool:
    """Whether this process runs one thread (native ones counted: a fork copies only the caller's)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def fork_ranks(world: int, entrypoint, *args) -> None:
    """`entrypoint(*args)` on `world` ranks forked from this process, with the environment torchrun gives a rank
    (env:// rendezvous on a free local port): for a process with one thread that has imported meshlm's trainer
    already (a fork of conftest's zygote), where a fork server would import it all again. When a rank fails,
    the others are killed (they would wait in a collective for it) and this process exits 1."""
    port, pids, run_id = _free_port(), [], f"family-runs-{os.getpid()}"
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
            os.environ.update({k: str(v) for k, v in ranks.items()})
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id)
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
            code = 1
            try:
                entrypoint(*args)
                code = 0
            except BaseException:  # noqa: BLE001 - what torchrun's rank would print before exiting 1
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = False
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for other in pids:
                os.kill(other, 9)
    if failed:
        sys.exit(1)


def launch_ranks(world: int, entrypoint, *args) -> None:
    """`entrypoint(*args)` (a module-level function) on `world` local ranks (torchrun's --standalone rendezvous),
    forked from a fork server that imported meshlm's trainer (meshlm's RANK_IMPORTS) and the entrypoint's module
    where no CUDA device is: a forked rank cannot use CUDA set up before the fork, so with GPUs each rank imports
    for itself. The fork server is stopped and waited for at the end, so that its CPU time and its ranks' count as
    this process's children's (pytest's --cpu-times)."""
    import multiprocessing
    import uuid

    from torch.distributed.launcher.api import elastic_launch

    if _one_thread() and "meshlm.train.trainer" in sys.modules and not torch.cuda.is_available():
        return fork_ranks(world, entrypoint, *args)

    from meshlm import compat
    from meshlm.launch import RANK_IMPORTS

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([] if torch.cuda.is_available() else [*RANK_IMPORTS, entrypoint.__module__])
    config = compat.launch_config(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    try:
        elastic_launch(config, entrypoint=entrypoint)(*args)
    finally:
        compat.stop_fork_server()


if __name__ == "__main__":
    if sys.argv[1] == "--nproc":
        import family_runs  # the ranks unpickle family_runs.main, not __main__'s

        family_runs.launch_ranks(int(sys.argv[2]), family_runs.main, *sys.argv[3:5])
    else:
        main(*sys.argv[1:3])
