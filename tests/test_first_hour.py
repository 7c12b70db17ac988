"""A new user's first hour: the README's commands, in the README's order, on a fresh clone; no error and no
traceback in anything they print, and each exits 0. Then `make train` once more: its run is finished, it
says so and exits 0.

The clone is `git clone` of this checkout (what is committed); it reuses this checkout's virtual environment
(a symbolic link, its install stamp kept current, so `make` installs nothing) with the clone's own `src` first
on the path, so the clone's code runs. Commands are run as typed, with options appended that make them small
(a tiny model, a few steps, 2 ranks where the README says 4; verify: one layout), since the suite must stay
fast. `make test` is the suite itself and is not run from here.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMALL_MODEL = (
    "--arch.hidden-size 64 --arch.layers 2 --arch.heads 4 --arch.kv-heads 2 --arch.intermediate-size 128 "
    "--builtin-samples 200"
)
SMALL_RUN = "--seq-length 64 --max-steps 3 --log-every 1"
PROBLEM = re.compile(r"Traceback|\berror\b|\bError\b|\bERROR\b|exception", re.IGNORECASE)


def readme_commands() -> list[str]:
    """Every command line of the README's bash blocks, in order, without its comment."""
    commands, inside = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        command = re.sub(r"\s+#.*$", "", line).strip() if inside else ""
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def small(command: str) -> str | None:
    """The command as the test runs it (None: not run here): 4 ranks become 2 (on 2 cores the rest is waiting)."""
    if command.startswith("make test"):
        return None  # the suite itself
    command = command.replace("--nproc-per-node 4", "--nproc-per-node 2")
    two = " --nproc 2" if "--nproc 4" in command else ""
    if command == "make train":
        return f'make train ARGS="{SMALL_MODEL} {SMALL_RUN}"'
    if "meshlm train" in command and "--model-name" in command:  # the user's own model and data (made below)
        return f"{command} --max-steps 2 --micro-batch-size 2"
    if "meshlm train" in command:
        return f"{command}{two} {SMALL_MODEL} {SMALL_RUN}"
    if command.startswith("meshlm verify"):
        return f"{command}{two} --layouts ddp --steps 2"
    return command


def _users_model_and_data(clone: Path) -> None:
    """What `--model-name ./my-llama --dataset-name data.jsonl` stand for: a (tiny) Llama with 512 positions
    saved by transformers, and a few Alpaca records."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from meshlm.data.builtin import byte_tokenizer

    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(clone / "my-llama")
    byte_tokenizer().save_pretrained(clone / "my-llama")
    records = [{"instruction": f"Add {i} and {i + 1}.", "output": str(2 * i + 1)} for i in range(40)]
    (clone / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("first-hour") / "meshlm"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    venv = ROOT / ".venv"
    (where / ".venv").symlink_to(venv)
    stamp = venv / ".meshlm-installed"  # the Makefile's install stamp: newer than the clone's pyproject.toml
    os.utime(where / "pyproject.toml", (stamp.stat().st_mtime - 60,) * 2)
    _users_model_and_data(where)
    return where


def _run(command: str, clone: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{clone / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",  # `. .venv/bin/activate`
        "VIRTUAL_ENV": str(clone / ".venv"),
        "PYTHONPATH": str(clone / "src"),
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=900)


def test_the_readme_in_order_on_a_fresh_clone(clone):
    commands = readme_commands()
    assert commands[:3] == ["make train", "make test", "make gpu-check"] and len(commands) >= 12, commands
    for command in commands:
        run = small(command)
        if run is None or command.startswith(". "):
            continue  # the activation is the environment every command gets
        p = _run(run, clone)
        shown = f"$ {run}\n--- exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
        assert p.returncode == 0, shown
        problems = [ln for ln in (p.stdout + p.stderr).splitlines() if PROBLEM.search(ln)]
        assert not problems, f"{problems[:5]}\n{shown}"
    for run_dir in ("meshlm", "one-process", "ddp4", "torchrun", "tiny", "my-llama", "pipeline"):
        assert (clone / "outputs" / run_dir / "checkpoints" / "latest").is_file(), run_dir  # one directory each
    assert (clone / "outputs" / "meshlm" / "plots" / "loss.png").is_file()  # meshlm report

    again = _run(small("make train"), clone)
    assert again.returncode == 0 and "already finished at step 3" in again.stdout, again.stdout + again.stderr
