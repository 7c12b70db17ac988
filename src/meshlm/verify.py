"""`meshlm verify`: train one model on the same global batches under every layout and compare with one device.

Every run is a real `meshlm train` in a process of its own (train_child.py: the trainer a user runs), in fp32,
with the data-parallel micro-batch chosen so that each optimizer step sees the same
global batch. Compared with the single-process reference:

  loss       per-step loss (mean over data-parallel ranks), max relative difference
  grad norm  per-step global gradient norm before clipping, max relative difference
  params     final parameters read back from each run's DCP checkpoint, gathered whole
             in this process: max over tensors of ||a - b|| / ||b - b0||, the difference
             relative to how far training moved the tensor from its initial value b0
  state      rank 0's parameter + gradient + optimizer bytes as a fraction of the reference:
             a layout that claims to shard (ZeRO, FSDP, TP, PP) and does not is a failure
  rewards    --objective dpo: per-step rewards and log-probabilities of chosen and rejected
             (train/dpo.py), max over them of max|a - b| / max|b| over the steps (rewards start at 0)

Layouts come from what the rank count allows; one that meshlm cannot run here (`layout.resolve`
rejects it for this model and rank count, or there are fewer GPUs than ranks) gets a "not available" row,
decided before anything runs, and is never counted as verified. A run that fails anyway is an
error row and fails the verification.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshlm import train_child
from meshlm.config import Config
from meshlm.errors import EXIT_USAGE, MeshlmError
from meshlm.verify_cases import CONTROLLED, PRESETS, REFERENCE, Case, layouts, unavailable
from meshlm.verify_compare import TOLERANCE, Row, compare, max_rel, param_diff

# The names verify's callers (cli.py, tests) read from here: the cases and the comparison live in their own modules.
__all__ = [
    "CONTROLLED",
    "PRESETS",
    "TOLERANCE",
    "Case",
    "Options",
    "Row",
    "compare",
    "layouts",
    "max_rel",
    "param_diff",
    "unavailable",
    "verify",
]


def _read_metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _read_params(out: Path, steps: int) -> dict:
    import warnings

    from meshlm.compat import load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        sd = load_state_dict_from_keys({"model"}, checkpoint_id=str(out / "checkpoints" / f"step-{steps}" / "state"))
    return sd["model"]


def initial_values(cfg: Config):
    """Each saved tensor's value before training, for param_diff: LoRA's adapters (B zeros, A its seeded
    Kaiming draw; the base is frozen and not saved), else the whole model as training fills it (the seeded
    init or --model-name's weights, the same in every layout)."""
    if cfg.lora.r:
        from meshlm.parallel.lora import initial_value

        return lambda name, like: initial_value(name, like, cfg.seed)
    from meshlm.models.source import ModelSource

    source = ModelSource.of_config(cfg)
    model = source.on_meta()
    state = source.fill(model, source.initial_weights(model), "cpu").state_dict()
    return lambda name, like: state.get(name)


def layout_argv(
    case: Case, base_args: list[str], out: Path, steps: int, global_batch: int, grad_accum: int
) -> list[str]:
    """The `meshlm train` options verify runs `case` with (its --nproc included when it has one)."""
    return [
        *base_args,
        *case.train_args(global_batch, grad_accum),
        "--max-steps",
        str(steps),
        "--log-every",
        "1",
        "--mixed-precision",
        "no",
        "--resume",
        "false",
        "--save-final",
        "true",
        "--ckpt-every",
        "0",
        "--progress",
        "false",
        "--dropout-off",
        "true",
        "--output-dir",
        str(out),
    ]


def run_layout(
    case: Case, base_args: list[str], out: Path, steps: int, global_batch: int, grad_accum: int
) -> tuple[int, float, str]:
    """`meshlm train` for one layout; (exit status, seconds, console text)."""
    t = time.perf_counter()
    p = train_child.run(layout_argv(case, base_args, out, steps, global_batch, grad_accum))
    seconds = time.perf_counter() - t
    console = f"$ {' '.join(p.args)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify-console.txt").write_text(console)
    return p.returncode, seconds, p.stderr


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("meshlm: error:")]
    return lines[-1].removeprefix("meshlm: error: ") if lines else ""


@dataclass
class Options:
    base_args: list[str]  # config options (model, data, arch ...) passed to every run
    cfg: Config  # the same, resolved: for static checks
    world: int
    names: list[str] | None  # None: all
    steps: int
    global_batch: int
    out: Path
    plot: bool
    tol: dict
    keep: bool = False  # every run's directory, not only those of the layouts that failed


def verify(o: Options, gpus: int = 0) -> int:
    """Run the reference and every layout asked for; print the table; 0 if all ran within tolerance."""
    from meshlm.models.build import model_config
    from meshlm.models.families import facts

    known = layouts(o.world, gpus, experts=bool(o.cfg.model_name and facts(model_config(o.cfg)).experts))
    if o.names is not None:
        by_name = {lay.name: lay for lay in known}
        bad = [n for n in o.names if n not in by_name]
        if bad:
            raise MeshlmError(
                f"--layouts: {', '.join(bad)} is not a layout for {o.world} ranks; "
                f"choose from {', '.join(by_name)} (or all)"
            )
        known = [by_name[n] for n in o.names]
    plan = [(lay, unavailable(lay, o.cfg, o.global_batch, gpus)) for lay in known]
    if o.names is not None and all(why for _, why in plan):
        raise MeshlmError("no layout asked for can run here: " + "; ".join(f"{lay.name}: {why}" for lay, why in plan))
    if o.out.exists() and any(o.out.iterdir()):
        raise MeshlmError(f"--output-dir {o.out} is not empty; give a new directory for this verification")

    header(o)
    ref_out = o.out / REFERENCE.name
    ref_args, layout_args = replayed(o, ref_out)
    status, seconds, stderr = run_layout(REFERENCE, ref_args, ref_out, o.steps, o.global_batch, o.cfg.grad_accum)
    if status == EXIT_USAGE:
        raise MeshlmError(_last_error(stderr) or f"the reference run failed on bad input; see {ref_out}")
    if status:
        print(
            f"meshlm verify: the single-process reference run failed (exit {status}); see "
            f"{ref_out / 'verify-console.txt'}",
            file=sys.stderr,
        )
        return 1
    ref_rows, ref_params = _read_metrics(ref_out), _read_params(ref_out, o.steps)
    dpo = o.cfg.objective == "dpo"
    ref = Row(
        "single", 1, "reference", 0.0, 0.0, 0.0, 1.0, 0.0 if dpo else math.nan, seconds, [r["loss"] for r in ref_rows]
    )
    print_row(ref, dpo)
    results, start = [ref], initial_values(o.cfg)
    for lay, why in plan:
        row = Row(lay.name, max(1, lay.nproc))
        if why:
            row.status = why
        else:
            out = o.out / lay.name
            status, row.seconds, stderr = run_layout(lay, layout_args, out, o.steps, o.global_batch, o.cfg.grad_accum)
            # Whether a layout can run was settled above; a run that still stops (bad input found late,
            # a non-finite loss, a crash) is a failure of this layout, never a quiet "not available".
            if status:
                why = _last_error(stderr) or f"exit {status}"
                row.status = f"error: {why}; see {out / 'verify-console.txt'}"
            else:
                got, params = _read_metrics(out), _read_params(out, o.steps)
                compare(row, ref_rows, got, ref_params, params, lay, o.tol, start)
        print_row(row, dpo)
        results.append(row)
    return summary(o, results)


UNIT = {"dpo": "pair", "grpo": "GRPO (--grpo.loss) on the single run's completions,"}  # what the loss averages


def replayed(o: Options, ref_out: Path) -> tuple[list[str], list[str]]:
    """The options of the reference run and of the layouts' runs. --objective grpo: the reference writes its
    completions and every layout trains on them (--grpo.replay), so that no sampling difference (a token drawn
    from logits equal to rounding) hides or makes a difference in the loss."""
    if o.cfg.objective != "grpo":
        return o.base_args, o.base_args
    from meshlm.objectives.grpo import COMPLETIONS

    ref = [*o.base_args, "--grpo.log-completions", "true"]
    return ref, [*o.base_args, "--grpo.replay", str(ref_out / COMPLETIONS)]


def header(o: Options) -> None:
    t = o.tol
    print(
        f"meshlm verify: {o.steps} steps, global batch {o.global_batch}, fp32, dropout off (layouts draw its masks "
        f"differently), loss = {UNIT.get(o.cfg.objective, 'token')} mean over the global batch, up to "
        f"{o.world} ranks; runs in {o.out}"
    )
    print(
        f"tolerance: loss {t['loss']:g} and grad norm {t['grad_norm']:g} (max relative difference from single over "
        f"the steps), parameters {t['params']:g} (final, per tensor ||a-b|| / ||b-b0||, b0 its initial value)"
    )
    if o.cfg.objective == "dpo":
        print(f"--objective dpo: rewards and log-probabilities {t['rewards']:g} (max|a-b| / max|b| over the steps)")
    rewards = f"  {'rewards':>9}" if o.cfg.objective == "dpo" else ""
    print(
        f"{'layout':<14}{'ranks':>5}  {'loss':>9}  {'grad norm':>9}  {'params':>9}{rewards}  {'state/rank':>10}  "
        f"{'time s':>7}  result"
    )


def print_row(r: Row, dpo: bool = False) -> None:
    def num(x, fmt="{:9.2e}"):
        return f"{'-':>9}" if math.isnan(x) else fmt.format(x)

    result = r.status if not r.problems else f"{r.status}: {'; '.join(r.problems)}"
    rewards = f"  {num(r.rewards)}" if dpo else ""
    print(
        f"{r.layout:<14}{r.ranks:>5}  {num(r.loss)}  {num(r.grad_norm)}  {num(r.params)}{rewards}  "
        f"{num(r.state, '{:10.2f}'):>10}  {num(r.seconds, '{:7.1f}'):>7}  {result}",
        flush=True,
    )


def summary(o: Options, results: list[Row]) -> int:
    rows = results[1:]
    ran = [r for r in rows if r.available]
    ok = [r for r in ran if r.status == "ok"]
    asked = o.names is not None
    missing = [r for r in rows if not r.available]
    (o.out / "verify.json").write_text(
        json.dumps(
            {
                "tolerance": o.tol,
                "steps": o.steps,
                "global_batch": o.global_batch,
                "world": o.world,
                "rows": [asdict(r) for r in results],
            },
            indent=1,
        )
    )
    if o.plot:
        from meshlm.report import plot_verify

        print(f"plot: {plot_verify(results, o.out / 'verify-loss.png')}")
    print(tidy(o, results))  # before the verdict, which stays the last line
    print(
        f"verify: {len(ok)} of {len(ran)} layouts that ran match single within tolerance; "
        f"{len(missing)} not available{' (asked for by name)' if asked and missing else ''}"
    )
    # A layout named on the command line that could not run is not verified; with `all` it is informational.
    return 0 if ran and len(ok) == len(ran) and not (asked and missing) else 1


def tidy(o: Options, results: list[Row]) -> str:
    """Remove the run directories nobody needs: those of the layouts that matched, and the reference's when every
    layout did (a failed layout's run is what its console text and checkpoint explain); the line that says so."""
    failed = [r for r in results[1:] if r.available and r.status != "ok"]
    ran = [r for r in results if r.available]
    kept = [r.layout for r in ran if o.keep or r in failed or (r is results[0] and failed)]
    for r in ran:
        if r.layout not in kept:
            shutil.rmtree(o.out / r.layout, ignore_errors=True)
    if not kept:
        return f"runs removed; {o.out} holds verify.json (--keep keeps every run's directory)"
    size = sum(f.stat().st_size for name in kept for f in (o.out / name).rglob("*") if f.is_file())
    return f"runs kept in {o.out} ({size / 2**20:.1f} MiB): {', '.join(kept)}"
