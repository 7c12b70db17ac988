"""Shared test helpers: run the real CLI in real processes (gloo on CPU), read what runs wrote."""

from __future__ import annotations

import json
import os
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


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """One token cache for the whole session (tokenising once), isolated from the user's ~/.cache."""
    os.environ["MESHLM_CACHE"] = str(tmp_path_factory.mktemp("meshlm-cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_meshlm(
    *args: str, env: dict | None = None, timeout: float = 600, check: bool = True, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m meshlm ARGS` in a fresh process; with check, a failure shows its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    p = subprocess.run(
        [sys.executable, "-m", "meshlm", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"meshlm {' '.join(map(str, args))} exited {p.returncode}\n"
            f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
        )
    return p


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in metrics(out)]


def assert_close(a: list[float], b: list[float], rtol: float) -> None:
    assert len(a) == len(b) and len(a) > 0, (a, b)
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst <= rtol, f"max relative difference {worst:.3g} > {rtol:g}\n{a}\n{b}"


def tree_digest(path: Path) -> dict[str, str]:
    """File name -> sha256 of content, for "nothing in the output directory changed" checks."""
    import hashlib

    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(path).rglob("*"))
        if p.is_file()
    }


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


def run_several(nproc: int, runs: list[list[str]], spec: Path, timeout: float = 900) -> None:
    """Every `meshlm train` command line of `runs` (config keys, each with its --output-dir) in one launch of
    `nproc` ranks (tests/several_runs.py): one start-up for several layouts."""
    spec.write_text(json.dumps([[str(a) for a in args] for args in runs]))
    script = Path(__file__).with_name("several_runs.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, spec]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
