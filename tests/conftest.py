"""Shared test helpers: run the real CLI in real processes (gloo on CPU), read what runs wrote."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The suite runs on CPU ranks (gloo) on every machine: a GPU box must not turn `--nproc 4` into "local rank
# 2 has no GPU" (with fewer than 4 GPUs) or into NCCL runs. Hidden before anything initialises CUDA, and
# inherited by every process a test starts. GPU runs are `make gpu-check` (benchmarks/gpu_check.py), which
# sets MESHLM_TEST_GPU=1 to run the tests marked gpu with the GPUs visible.
if os.environ.get("MESHLM_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# meshlm's import filters torchao's import-time log lines (meshlm/__init__.py): before any test module
# imports transformers
import meshlm  # noqa: E402, F401

# A tiny Llama (hidden 64, 2 layers, 4 heads, 2 kv heads) on a short synthetic corpus: seconds per run.
TINY = [
    "--arch.hidden-size",
    "64",
    "--arch.layers",
    "2",
    "--arch.heads",
    "4",
    "--arch.kv-heads",
    "2",
    "--arch.intermediate-size",
    "128",
    "--builtin-samples",
    "400",
    "--seq-length",
    "64",
    "--progress",
    "false",
    "--log-every",
    "1",
    "--warmup-steps",
    "2",
]


def without_arch(args: list) -> list:
    """`args` without its --arch.* options (and their values): what goes with --model-name, whose config sets them."""
    pairs = zip(args[::2], args[1::2])
    return [x for key, value in pairs if not str(key).startswith("--arch.") for x in (key, value)]


# ------------------------------------------------------------------ CPU seconds per test (--cpu-times)
# Wall times on a shared 2-core machine follow its load; CPU seconds barely do. --cpu-times charges each test
# the user + system time of this process and of every process it started and waited for (a meshlm launcher
# and, through it, its ranks), from the start of its setup to the end of its teardown: a module fixture's runs
# count for the test that set it up. Printed per module, for the costliest tests, and for the `meshlm` launches
# (run_meshlm) made more than once with the same arguments (output directories aside): candidates for a shared
# fixture. `--cpu-times-json PATH` also writes {test id: seconds} to PATH. Under xdist each worker measures
# its own tests. (A flag with an optional value would swallow the test path after it: `--cpu-times tests` wrote
# to ./tests and failed the run after every test had passed.)


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-times",
        action="store_true",
        help="print CPU seconds (this process and its children) per test module and for the costliest tests",
    )
    parser.addoption("--cpu-times-json", metavar="PATH", help="with --cpu-times: also write {test id: seconds}")


def _cpu_seconds() -> float:
    """This process's CPU seconds and those of its ended children, the zygote's included (run_meshlm)."""
    import resource

    return _ZYGOTE_CPU + sum(
        u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


_CPU_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if not item.config.getoption("cpu_times"):
        _LAUNCHES.clear()
        return
    now = _cpu_seconds()
    start = item.stash.get(_CPU_START, now)
    item.stash[_CPU_START] = now
    outcome.get_result().user_properties += [("cpu_s", now - start), ("launches", list(_LAUNCHES))]
    _LAUNCHES.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("cpu_times"):
        item.stash[_CPU_START] = _cpu_seconds()


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == "cpu_s":
            _CPU_TIMES[report.nodeid] = _CPU_TIMES.get(report.nodeid, 0.0) + value
        elif key == "launches":
            for args, seconds in value:
                _LAUNCHED.setdefault(args, []).append((report.nodeid, seconds))


_CPU_TIMES: dict[str, float] = {}  # test id -> CPU seconds
_LAUNCHES: list[tuple[str, float]] = []  # this process's run_meshlm launches since the last report
_LAUNCHED: dict[str, list[tuple[str, float]]] = {}  # launch arguments -> (test id, CPU seconds) per launch


def _launch_key(args: tuple) -> str:
    """A launch's arguments with its output directory left out and paths in pytest's temporary directories
    reduced to their last part, so that the same job launched by two tests has one key."""
    args = [str(a) for a in args]
    keep = [a for i, a in enumerate(args) if not (i and args[i - 1] in ("--output-dir", "--out"))]
    return " ".join(Path(a).name if "pytest-" in a else a for a in keep)


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("cpu_times") or not _CPU_TIMES:
        return
    modules: dict[str, list[float]] = {}
    for nodeid, s in _CPU_TIMES.items():
        modules.setdefault(nodeid.split("::")[0], []).append(s)
    write = terminalreporter.write_line
    write(f"CPU seconds per module (this process + children; {sum(_CPU_TIMES.values()):.1f} s in all)")
    for module, times in sorted(modules.items(), key=lambda kv: -sum(kv[1])):
        write(f"{sum(times):9.1f}  {len(times):4d} tests  {module}")
    write("costliest tests")
    for nodeid, s in sorted(_CPU_TIMES.items(), key=lambda kv: -kv[1])[:30]:
        write(f"{s:9.1f}  {nodeid}")
    again = {k: v for k, v in _LAUNCHED.items() if len(v) > 1}
    write(f"meshlm launches made more than once with the same arguments ({len(again)})")
    for args, runs in sorted(again.items(), key=lambda kv: -sum(s for _, s in kv[1]))[:20]:
        tests = sorted({nodeid.split("[")[0] for nodeid, _ in runs})
        write(f"{sum(s for _, s in runs):9.1f}  {len(runs)}x  meshlm {args[:200]}\n           by {', '.join(tests)}")
    if config.getoption("cpu_times_json"):
        Path(config.getoption("cpu_times_json")).write_text(json.dumps(_CPU_TIMES, indent=1, sort_keys=True))


# ------------------------------------------------------------------ costliest modules first
# `make test` runs two xdist workers, one module at a time each (--dist loadscope). xdist's own order (most tests
# first) left the one-test modules that take minutes (test_first_hour, test_no_full_copy, test_plan) for the
# end, where one worker ran them while the other sat idle. Longest first, then the rest, then the unit tests
# that fill the gaps: the workers finish together. CPU seconds per module from `make test`'s --cpu-times (with
# the zygote and the launcher's forked ranks); a stale order costs balance only.
COSTLIEST_FIRST = [
    "test_model_parallel.py",  # 283
    "test_families.py",  # 261
    "test_moe.py",  # 121
    "test_first_hour.py",  # 117
    "test_dpo.py",  # 113
    "test_lora.py",  # 76
    "test_errors.py",  # 60
    "test_faults.py",  # 51, and hangs waited for: more wall than CPU
    "test_launch.py",  # 51, two launchers on one core
    "test_plan_simulate_zero.py",  # 56
    "test_first_week.py",  # 55
    "test_sharded.py",  # 51
    "test_no_full_copy.py",  # 49
    "test_generate.py",  # 48
    "test_grpo.py",  # 47
    "test_context.py",  # 46
    "test_qlora.py",  # 43
    "test_verify.py",  # 41
    "test_plan.py",  # 37
    "test_rendezvous.py",  # 33
    "test_plan_simulate.py",  # 23
    "test_train.py",  # 23
]
# The same within tests/unit, which `make test-compat` runs alone (with tests/test_release_range.py, first: a
# tests/ module): in file order its longest modules (the planner's) came last, one worker simulating plans while
# the other had finished. Seconds per module of a test-compat run on a quiet machine (load 4), where test_zygote
# starts its worker's zygote (that worker's first launch) and test_gpu_check_driver waits out a row's deadline.
UNIT_COSTLIEST_FIRST = [
    "test_plan_simulate_stages.py",  # 14
    "test_plan_context.py",  # 9
    "test_plan_moe.py",  # 8
    "test_zygote.py",  # 5, 15 with the zygote's start
    "test_gpu_check_driver.py",  # 8, most of it waited
    "test_planner.py",  # 7
    "test_compat.py",  # 7
    "test_plan_cpu.py",  # 5
    "test_ring_zigzag.py",  # 5
    "test_host_memory.py",  # 4
    "test_plan_simulate_pipeline.py",  # 4
    "test_versions.py",  # 4
    "test_report.py",  # 3
    "test_family_registry.py",  # 3
    "test_attention_kernels.py",  # 2
    "test_chunked_loss.py",  # 2
]


def pytest_collection_modifyitems(config, items):
    """Modules in COSTLIEST_FIRST's order, then the other tests/ modules, then tests/unit in UNIT_COSTLIEST_FIRST's
    order, then the other unit modules (a stable sort: tests keep their order within a module). Run with xdist's
    --no-loadscope-reorder, which keeps this order."""

    def rank(item) -> int:
        path = Path(str(item.fspath))
        if path.parent.name == "unit":
            unit = (
                UNIT_COSTLIEST_FIRST.index(path.name)
                if path.name in UNIT_COSTLIEST_FIRST
                else len(UNIT_COSTLIEST_FIRST)
            )
            return len(COSTLIEST_FIRST) + 1 + unit
        return COSTLIEST_FIRST.index(path.name) if path.name in COSTLIEST_FIRST else len(COSTLIEST_FIRST)

    items.sort(key=rank)


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """One token cache for the whole session (tokenising once), isolated from the user's ~/.cache."""
    os.environ["MESHLM_CACHE"] = str(tmp_path_factory.mktemp("meshlm-cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def session_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this test session sees (each worker's basetemp lies below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared(tmp_path_factory, name: str, make) -> Path:
    """`make(path)` once per test session, by whichever xdist worker asks first: the others wait on a file lock
    and reuse what it wrote. Session-scoped fixtures alone run once per worker. Users only read `path`."""
    from filelock import FileLock

    root = session_dir(tmp_path_factory) / "shared"
    root.mkdir(exist_ok=True)
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            done.touch()
    return out


# Variables a process reads when it starts or imports a library (the import path, the C allocator, the dynamic
# linker, huggingface_hub's and transformers' settings, torch's and CUDA's): a launch that sets one gets a fresh
# interpreter, where a fork of the zygote would keep the values it was started with.
_AT_START = ("PYTHON", "MALLOC_", "LD_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "CUDA_")


class _Zygote:
    """helpers/zygote.py, started on the first launch of this process (an xdist worker) and kept for its
    session: `python -m meshlm` forked from a process that has imported it, instead of a new interpreter."""

    def __init__(self, tmp: Path):
        self.tmp, self.count, self.env = tmp, 0, {**os.environ, "PYTHONUNBUFFERED": "1"}  # as run_meshlm sets it
        noise = tmp / "import-output.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(Path(__file__).parent / "helpers" / "zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**self.env, "MESHLM_ZYGOTE_NOISE": str(noise)},
        )
        ready = self.proc.stdout.readline()
        # Output at import shows on a fresh interpreter's console: with any, every launch gets one.
        self.usable = bool(ready) and not noise.read_text()

    def started_as(self, env: dict) -> bool:
        """Whether `env` has the start-up variables (_AT_START) this process was started with."""

        def at_start(e: dict) -> dict:
            return {k: v for k, v in e.items() if k.startswith(_AT_START)}

        return at_start(env) == at_start(self.env)

    def run(self, args: list[str], env: dict, cwd, timeout: float, script=None) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.tmp / f"{self.count}.out", self.tmp / f"{self.count}.err"
        request = {"argv": args, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(out), "stderr": str(err)}
        request |= {"script": str(script)} if script else {}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        done = self._reply(timeout)
        if done is None:
            os.kill(pid, 9)
            self._reply(None)
            raise subprocess.TimeoutExpired([sys.executable, "-m", "meshlm", *args], timeout)
        global _ZYGOTE_CPU
        _ZYGOTE_CPU += done["cpu"]
        return subprocess.CompletedProcess(args, done["status"], out.read_text(), err.read_text())

    def _reply(self, timeout: float | None) -> dict | None:
        import select

        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        return json.loads(self.proc.stdout.readline())


_ZYGOTE: list = []  # this process's _Zygote, once started
_ZYGOTE_CPU = 0.0  # CPU seconds of the zygote's ended children (getrusage cannot see them: not ours)
_ZYGOTE_LOCK = __import__("threading").Lock()


def _zygote() -> _Zygote | None:
    if not _ZYGOTE:
        import tempfile

        _ZYGOTE.append(_Zygote(Path(tempfile.mkdtemp(prefix="meshlm-zygote-"))))
    return _ZYGOTE[0] if _ZYGOTE[0].usable else None


def pytest_sessionfinish(session):
    """The zygote ends with the session (its stdin closed), and is waited for so that its CPU is counted."""
    for zygote in _ZYGOTE:
        zygote.proc.stdin.close()
        zygote.proc.wait(timeout=60)


def _forked(args: list[str], env: dict, cwd, timeout: float, script=None) -> subprocess.CompletedProcess | None:
    """The launch forked from this process's zygote, or None where it needs a new interpreter (run_meshlm)."""
    if not _ZYGOTE_LOCK.acquire(blocking=False):
        return None
    try:
        zygote = _zygote()
        return zygote.run(args, env, cwd, timeout, script) if zygote and zygote.started_as(env) else None
    finally:
        _ZYGOTE_LOCK.release()


def run_python(cmd: list[str], *, env: dict, timeout: float, **run) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, ...) for cmd = [python, SCRIPT, *args], forked from
    the zygote where run_meshlm's would be: helpers/family_runs.py's launches (its START)."""
    assert run == {"capture_output": True, "text": True}, run
    p = _forked([str(a) for a in cmd[2:]], env, None, timeout, script=cmd[1]) if cmd[0] == sys.executable else None
    return p or subprocess.run(cmd, env=env, timeout=timeout, **run)


def run_meshlm(
    *args: str,
    env: dict | None = None,
    timeout: float = 600,
    check: bool = True,
    cwd: str | Path | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m meshlm ARGS` in a process of its own; with check, a failure shows its output. The process is
    forked from the zygote unless `fresh` (a new interpreter: for what happens at import), the environment
    differs from the zygote's in a variable read at start-up, or another thread of this process is launching."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    args = [str(a) for a in args]
    start = _cpu_seconds()
    p = None if fresh else _forked(args, full_env, cwd, timeout)
    if p is None:
        p = subprocess.run(
            [sys.executable, "-m", "meshlm", *args],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            cwd=cwd,
        )
    _LAUNCHES.append((_launch_key(args), _cpu_seconds() - start))
    if check and p.returncode != 0:
        raise AssertionError(
            f"meshlm {' '.join(args)} exited {p.returncode}\n"
            f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
        )
    return p


def _start_family_runs_forked() -> None:
    from helpers import family_runs

    family_runs.START = run_python


_start_family_runs_forked()


def run_cases(world: int, cases: list[dict], workdir: Path) -> dict:
    """Several runs in one launch of `world` ranks (helpers/family_runs.py: meshlm's trainer in the ranks of one
    job, in turn), so that a module pays one process start-up per rank, not one per run and rank: most of a tiny
    run's CPU time is importing torch and transformers. Every case must succeed; the results by case id."""
    from helpers.family_runs import launch

    results = launch(world, {"cases": cases}, workdir)
    errors = {k: r["error"] for k, r in results.items() if "error" in r}
    assert not errors and set(results) == {c["id"] for c in cases}, errors
    return results


def meshlm_here(*args) -> None:
    """`meshlm ARGS` in this process, for a command that starts no ranks (export, generate in one process); it
    must succeed. A fresh process would pay ~5 s of CPU importing torch and transformers again: run_meshlm is for
    what needs a process of its own (ranks, signals, output on the console, exit statuses)."""
    from meshlm.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    assert e.value.code == 0, f"meshlm {' '.join(map(str, args))} exited {e.value.code}"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in metrics(out)]


def assert_close(a: list[float], b: list[float], rtol: float) -> None:
    """Every |a - b| / |b| within rtol. A NaN (or inf) on either side fails: `d <= rtol` is False for NaN, where
    Python's max() would skip a NaN that is not first."""
    assert len(a) == len(b) and len(a) > 0, (a, b)
    diffs = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    bad = [i for i, d in enumerate(diffs) if not d <= rtol]
    worst = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    assert not bad, f"relative difference {worst:.3g} > {rtol:g} at positions {bad}\n{a}\n{b}"


def tree_digest(path: Path) -> dict[str, str]:
    """File name -> sha256 of content, for "nothing in the output directory changed" checks."""
    import hashlib

    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(path).rglob("*"))
        if p.is_file()
    }


def family_config(name: str, **fields):
    """transformers' config class `name` built with `fields`, or None where the installed release lacks that
    family (newer than transformers' oldest supported release): its tests skip through `needs_family`."""
    import transformers

    cls = getattr(transformers, name, None)
    return None if cls is None else cls(**fields)


def needs_family(config, case: str):
    """`config`, or a skip of the running test when the installed transformers has no such family."""
    if config is None:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {case} family")
    return config


def save_llama(path: Path, hidden: int, layers: int, mlp: int, vocab: int) -> int:
    """A randomly initialised Llama (8 heads) with the byte tokenizer saved at `path`; its fp32 bytes. Only the
    sizes matter to the tests that use it (peak memory against the model's size)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshlm.data.builtin import byte_tokenizer

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=mlp,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    LlamaForCausalLM(cfg).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return 4 * n


# ------------------------------------------------------------------ runs shared by several test modules

SINGLE = [*TINY, "--max-steps", "10", "--strategy", "single", "--micro-batch-size", "8"]


@pytest.fixture(scope="session")
def single_run(tmp_path_factory) -> Path:
    """TINY in one process, 10 steps of global batch 8 (step-10 checkpoint): the reference of test_train's DDP
    runs and of test_sharded's layouts, run once per session."""
    return shared(tmp_path_factory, "single", lambda out: run_meshlm("train", *SINGLE, "--output-dir", out))


@pytest.fixture(scope="session")
def llama_45m(tmp_path_factory) -> tuple[Path, Path, int]:
    """A 45M Llama (180 MB in fp32, tensors of at most 8 MB) and a tiny one, saved once per session for the
    no-full-copy tests: (big directory, tiny directory, fp32 bytes of the big one)."""

    def make(root: Path) -> None:
        big = save_llama(root / "big", hidden=512, layers=12, mlp=1536, vocab=4096)
        save_llama(root / "tiny", hidden=64, layers=2, mlp=128, vocab=320)
        (root / "bytes.json").write_text(json.dumps({"big": big}))

    root = shared(tmp_path_factory, "llama-45m", make)
    return root / "big", root / "tiny", json.loads((root / "bytes.json").read_text())["big"]


def generate_peaks(source: list, prompts: Path, out: Path, mode: str) -> list[int]:
    """Every rank's peak RSS of `meshlm generate SOURCE --mode MODE --nproc 2` on `prompts`, two new tokens."""
    run_meshlm(
        "generate", *source, "--prompts", prompts, "--out", out, "--max-new-tokens", "2", "--mode", mode, "--nproc", "2"
    )
    summary = out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")
    return [r["mem_peak_bytes"] for r in json.loads(summary.read_text())["per_rank"]]


def one_prompt(path: Path) -> Path:
    path.write_text(json.dumps({"prompt": "1 2 3"}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_generate_peak(tmp_path_factory, llama_45m) -> int:
    """The fixed cost of a 2-rank tp `meshlm generate` (the tiny model's largest rank peak RSS), measured once:
    what the no-full-copy tests subtract from the 45M model's peaks."""

    def make(root: Path) -> None:
        root.mkdir()
        peaks = generate_peaks(["--model-name", llama_45m[1]], one_prompt(root / "p.jsonl"), root / "g.jsonl", "tp")
        (root / "peak.json").write_text(json.dumps(max(peaks)))

    return json.loads((shared(tmp_path_factory, "tiny-generate-peak", make) / "peak.json").read_text())


# Test cases (a family with its MoE) whose own forward fails in older transformers releases, whatever meshlm does:
# case -> (the first release checked to run it, the fault). 5.17 and 5.20 fail.
BROKEN_BEFORE = {
    "doge": ("5.23", "its MoE decoder layer passes the experts' (output, router logits) tuple to dropout"),
}


def needs_working_family(kind: str) -> None:
    """A skip of the running test where the installed transformers' own forward of case `kind` fails."""
    import transformers
    from packaging.version import Version

    first, fault = BROKEN_BEFORE.get(kind, ("0", ""))
    if Version(Version(transformers.__version__).base_version) < Version(first):
        pytest.skip(f"transformers {transformers.__version__}'s own {kind} forward fails: {fault} ({first} runs it)")
