"""`meshlm verify`: train one model on the same global batches under every layout and compare with one device.

Every run is a real `meshlm train` subprocess (the same trainer a user runs), in fp32,
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

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshlm.config import SCHEDULES, Config, set_key, to_args
from meshlm.errors import EXIT_USAGE, MeshlmError
from meshlm.layout import Layout, degrees, resolve, strategy_for

# Fixed by verify itself; a user setting them would make the runs incomparable.
CONTROLLED = (
    "strategy",
    "micro_batch_size",
    "max_steps",
    "mixed_precision",
    "devices",
    "log_every",
    "resume",
    "save_final",
    "ckpt_every",
    "progress",
    "wandb",
    "tensorboard",
    "dropout_off",
)

# `meshlm verify tiny`: small enough for CI, deep and wide enough for every layout on 4 ranks
# (8 layers: 4 pipeline stages x 2 virtual stages; 8 heads / 4 kv heads: tensor parallel 4).
PRESETS = {
    "tiny": [
        "--arch.hidden-size",
        "64",
        "--arch.layers",
        "8",
        "--arch.heads",
        "8",
        "--arch.kv-heads",
        "4",
        "--arch.intermediate-size",
        "128",
        "--seq-length",
        "64",
        "--builtin-samples",
        "400",
    ],
    "default": [],
}

# What the comparison tolerates in fp32. Runs differ only in the order of floating-point
# reductions (all-reduce, sharded matmuls), which AdamW then amplifies a little per step.
TOLERANCE = {"loss": 1e-4, "grad_norm": 1e-3, "params": 1e-3, "rewards": 1e-4}
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class Case:
    """One layout verify runs: the config keys that ask for it, and its ranks."""

    name: str
    nproc: int  # 0: one process (no launcher)
    strategy: str = "auto"
    tp: int = 1
    pp: int = 1
    shard_size: int = 0
    schedule: str = ""
    devices: str = ""
    ep: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return max(1, self.nproc) // (self.tp * self.pp * self.cp)

    @property
    def layout(self) -> Layout:
        """The layout the keys resolve to (degrees only; `unavailable` runs every check)."""
        world = max(1, self.nproc)
        strategy = strategy_for(self.strategy, world, self.tp, self.pp, self.ep, cp=self.cp)
        return Layout(strategy, degrees(strategy, world, self.tp, self.pp, self.shard_size, self.ep, cp=self.cp))

    def keys(self, global_batch: int, grad_accum: int) -> list[tuple[str, object]]:
        """Config keys of this layout, the micro-batch that keeps the global batch the same."""
        keys = [
            ("strategy", self.strategy),
            ("micro_batch_size", global_batch // (self.dp * grad_accum)),
            ("parallel.tp", self.tp),
            ("parallel.pp", self.pp),
        ]
        keys += [("parallel.shard_size", self.shard_size)] * bool(self.shard_size)
        keys += [("parallel.cp", self.cp)] * (self.cp > 1)
        keys += [("parallel.schedule", self.schedule)] * bool(self.schedule)
        keys += [("parallel.ep", self.ep)] * (self.ep > 1)
        return keys + [("devices", self.devices)] * bool(self.devices)

    def train_args(self, global_batch: int, grad_accum: int) -> list[str]:
        return to_args(self.keys(global_batch, grad_accum)) + ["--nproc", str(self.nproc)] * bool(self.nproc)


REFERENCE = Case("single", 0, "single")


def layouts(world: int, gpus: int, experts: bool = False) -> list[Case]:
    """Every layout `world` ranks allow, single-process ones first, then 1-D, then compositions; for a mixture
    of `experts` also expert parallel and its compositions."""
    devices = ",".join(f"cuda:{i}" for i in range(gpus)) if gpus >= 2 else ",".join(["cpu"] * max(2, world))
    out = [Case("dp", 0, "dp"), Case("layer-split", 0, "layer-split", devices=devices)]
    if world < 2:
        return out
    out += [Case(s, world, s) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")]
    if world % 2 == 0:  # on 2 ranks a "not available" row says why (unavailable)
        out.append(Case("hsdp", world, "hsdp", shard_size=world // 2))
    out.append(Case("tp", world, tp=world))
    out += [Case(f"pp-{s.replace('-1f1b', '')}", world, pp=world, schedule=s) for s in SCHEDULES]
    if world >= 4 and world % 2 == 0:
        out += [
            Case("fsdp+tp", world, "fsdp", tp=2),
            Case("ddp+pp", world, "ddp", pp=2),
            Case("fsdp+pp", world, "fsdp", pp=2),
            Case("tp+pp", world, tp=2, pp=world // 2),
        ]
    if world >= 8 and world % 8 == 0:
        out.append(Case("fsdp+tp+pp", world, "fsdp", tp=2, pp=2))
    out.append(Case("cp", world, cp=world))  # each sequence over every rank (parallel/context.py)
    if world >= 4 and world % 2 == 0:
        out += [
            Case("ddp+cp", world, "ddp", cp=2),
            Case("fsdp+cp", world, "fsdp", cp=2),
            Case("tp+cp", world, tp=2, cp=2),
            Case("pp+cp", world, pp=2, cp=2),
        ]
    if experts:
        out.append(Case("ep", world, "fsdp", ep=world))
    if experts and world >= 4 and world % 2 == 0:
        out += [
            Case("ep+fsdp", world, "fsdp", ep=2),
            Case("ep+tp", world, "fsdp", tp=2, ep=2),
            Case("ep+pp", world, "fsdp", pp=2, ep=2),
        ]
    if experts and world % 4 == 0:  # ep 2 over the data-parallel ranks of each cp rank: world / 2 of them
        out.append(Case("ep+cp", world, "fsdp", cp=2, ep=2))
    return out


def unavailable(case: Case, cfg: Config, global_batch: int, gpus: int = 0) -> str:
    """Why meshlm cannot run this layout here ('' when it can), decided before any process starts."""
    if gpus and case.nproc > gpus:
        return f"not available: {case.nproc} ranks need {case.nproc} GPUs, {gpus} visible"
    if case.strategy == "hsdp" and case.nproc < 4:
        return (
            f"not available: hsdp needs 4 ranks or more (shards within groups, replicas across groups); on "
            f"{case.nproc} it is ddp (shard size 1) or zero3 (shard size {case.nproc})"
        )
    if global_batch % (case.dp * cfg.grad_accum):
        return (
            f"not available: global batch {global_batch} does not split over {case.dp} data-parallel ranks "
            f"x {cfg.grad_accum} accumulation steps"
        )
    trial = copy.deepcopy(cfg)
    for k, v in case.keys(global_batch, cfg.grad_accum):
        set_key(trial, k, v)
    try:
        resolve(trial, max(1, case.nproc))
    except MeshlmError as e:
        return f"not available: {e}"
    return ""


# ------------------------------------------------------------------ comparison


@dataclass
class Row:
    layout: str
    ranks: int
    status: str = ""  # reference | ok | FAIL | error: ... | not available: ...
    loss: float = math.nan
    grad_norm: float = math.nan
    params: float = math.nan
    state: float = math.nan  # rank 0's model state bytes / the reference's
    rewards: float = math.nan  # --objective dpo: the rewards' difference (scaled_diff)
    seconds: float = math.nan
    losses: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    @property
    def available(self) -> bool:
        return not self.status.startswith("not available")


def max_rel(a: list[float], b: list[float]) -> float:
    """max |a - b| / |b| over the pairs; NaN when any pair gives NaN (a NaN or inf on either side) or the lengths
    differ, so that `not value <= tol` fails it. (Python's max() skips a NaN that does not come first.)"""
    if len(a) != len(b):
        return math.nan
    diffs = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=math.nan)


def scaled_diff(a: list[float], b: list[float]) -> float:
    """max |a - b| / max |b|: for values that start at exactly 0 (DPO's rewards, policy = reference). NaN as
    max_rel's: a NaN on either side or lengths that differ."""
    if len(a) != len(b):
        return math.nan
    diffs = [abs(x - y) for x, y in zip(a, b)]
    if any(math.isnan(d) for d in diffs):
        return math.nan
    return max(diffs, default=math.nan) / (max(abs(y) for y in b) or 1.0)


def param_diff(ref: dict, other: dict, start=None) -> tuple[float, str]:
    """max over tensors of ||a - b|| / ||b - b0||, and a problem ('' if none) when names or shapes differ.

    b0 is `start(name, b)`, the tensor's value before training, or zero when that gives None: the difference
    is measured against how far training moved the tensor, so an update that did not happen (or a gradient
    left unreduced) is a difference near 1 even where the tensor is large and moved little. In norm, not
    element by element: AdamW's first steps turn rounding-level differences of a gradient element that is
    zero in exact arithmetic (a key bias: softmax ignores a shift shared by every key) into updates near its
    eps, of either sign, a sizeable part of the largest update of a tensor that starts at zero.
    NaN anywhere gives NaN."""
    if ref.keys() != other.keys():
        missing, extra = sorted(ref.keys() - other.keys()), sorted(other.keys() - ref.keys())
        return math.inf, f"parameter names differ (missing {missing[:3]}, extra {extra[:3]})"
    diffs = []
    for k, b in ref.items():
        a = other[k]
        if a.shape != b.shape:
            return math.inf, f"{k} has shape {tuple(a.shape)}, the reference {tuple(b.shape)}"
        b0 = start(k, b) if start is not None else None
        moved = b.float() - b0.float() if b0 is not None and b0.shape == b.shape else b.float()
        scale = moved.norm().item() or b.float().norm().item() or 1.0
        diffs.append((a.float() - b.float()).norm().item() / scale)
    return (math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)), ""


def compare(
    row: Row,
    ref_rows: list[dict],
    rows: list[dict],
    ref_params: dict,
    params: dict,
    case: Case,
    tol: dict,
    start=None,
) -> Row:
    """Fill the row's differences from the reference and decide ok / FAIL (`start`: param_diff's)."""
    if [r["step"] for r in rows] != [r["step"] for r in ref_rows]:
        row.problems.append(f"logged steps {[r['step'] for r in rows]} differ from the reference's")
    row.losses = [r["loss"] for r in rows]
    row.loss = max_rel(row.losses, [r["loss"] for r in ref_rows])
    row.grad_norm = max_rel([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows])
    row.params, problem = param_diff(ref_params, params, start)
    if problem:
        row.problems.append(problem)
    row.state = rows[0]["model_state_bytes"] / ref_rows[0]["model_state_bytes"]
    checked = ["loss", "grad_norm", "params"]
    if REWARDS[0] in ref_rows[0]:
        row.rewards = max(scaled_diff([r[k] for r in rows], [r[k] for r in ref_rows]) for k in REWARDS)
        checked.append("rewards")
    for name in checked:
        value = getattr(row, name)
        if not value <= tol[name]:  # NaN fails too
            row.problems.append(f"{name.replace('_', '-')} difference {value:.3g} > {tol[name]:g}")
    if case.layout.shards_state and row.state > 0.99:
        row.problems.append(f"rank 0 holds {row.state:.2f} of the reference's model state: nothing was sharded")
    row.status = "FAIL" if row.problems else "ok"
    return row


# ------------------------------------------------------------------ running


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
    cmd = [sys.executable, "-m", "meshlm", "train", *layout_argv(case, base_args, out, steps, global_batch, grad_accum)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - t
    console = f"$ {' '.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
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
    status, seconds, stderr = run_layout(REFERENCE, o.base_args, ref_out, o.steps, o.global_batch, o.cfg.grad_accum)
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
            status, row.seconds, stderr = run_layout(lay, o.base_args, out, o.steps, o.global_batch, o.cfg.grad_accum)
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


def header(o: Options) -> None:
    t = o.tol
    print(
        f"meshlm verify: {o.steps} steps, global batch {o.global_batch}, fp32, dropout off (layouts draw its masks "
        f"differently), loss = {'pair' if o.cfg.objective == 'dpo' else 'token'} mean over the global batch, up to "
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
