"""Bad input: one `meshlm: error:` line on stderr, exit status 2, and the existing run left untouched."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import TINY, run_meshlm, tree_digest


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("existing") / "run"
    run_meshlm("train", *TINY, "--max-steps", "2", "--micro-batch-size", "4", "--output-dir", out)
    return out


def _small_dataset(tmp_path):
    p = tmp_path / "small.jsonl"
    p.write_text(json.dumps({"text": "only a few tokens"}) + "\n")
    return p


CASES = {
    "unknown strategy": (["--strategy", "zero9"], "--strategy must be one of"),
    "unknown option": (["--max-stepz", "3"], "unrecognized arguments: --max-stepz"),
    "non-integer": (["--max-steps", "ten"], "--max-steps needs an integer, got 'ten'"),
    "gpu ranks without gpus": (["--nproc", "2", "--backend", "nccl"], "visible GPU"),
    "missing dataset": (["--dataset-name", "nope/missing.jsonl"], "dataset file nope/missing.jsonl does not exist"),
    "seq longer than positions": (["--seq-length", "2048"], "larger than the model's 1024 positions"),
    "degrees do not divide": (["--nproc", "3", "--parallel.tp", "2"], "not divisible by tp x pp"),
    "another model": (["--arch.hidden-size", "96"], "is from another model"),
    "eval fraction out of range": (["--eval-fraction", "0.7"], "--eval-fraction must be in (0, 0.5]"),
    "trace without a pipeline": (["--trace-pipeline"], "--trace-pipeline draws a pipeline's schedule: it needs "
                                                       "--parallel.pp 2 or more"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_line_error_and_run_dir_unchanged(run_dir, case):
    extra, message = CASES[case]
    before = tree_digest(run_dir)
    p = run_meshlm("train", *TINY, "--max-steps", "4", "--micro-batch-size", "4", *extra, "--output-dir", run_dir,
                   check=False)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: ") and message in lines[0], p.stderr
    assert tree_digest(run_dir) == before


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]])
def test_dataset_smaller_than_one_global_batch(tmp_path, nproc):
    out = tmp_path / "out"
    p = run_meshlm("train", *TINY, "--dataset-name", _small_dataset(tmp_path), *nproc, "--output-dir", out,
                   check=False)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "fewer than one global batch" in lines[0], p.stderr
    assert not out.exists()


@pytest.mark.parametrize("damage", ["trainer.json", "shards"])
def test_corrupt_checkpoint(run_dir, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    step = run / "checkpoints" / "step-2"
    if damage == "trainer.json":
        (step / "trainer.json").write_text("{not json")
    else:
        for f in (step / "state").glob("*.distcp"):
            f.unlink()
    before = tree_digest(run)
    p = run_meshlm("train", *TINY, "--max-steps", "4", "--micro-batch-size", "4", "--output-dir", run, check=False)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("meshlm: error: checkpoint") and "step-2" in lines[0]
    assert tree_digest(run) == before


@pytest.mark.parametrize("record, message", [
    ({"question": "q", "answer": "a"}, "record 1: a record of unknown shape: found fields ['answer', 'question']; "
                                       "expected Alpaca"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat records need a tokenizer with a chat template"),
])
def test_records_meshlm_cannot_read(tmp_path, record, message):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(record) + "\n")
    out = tmp_path / "out"
    p = run_meshlm("train", *TINY, "--dataset-name", data, "--output-dir", out, check=False)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0], p.stderr
    assert not out.exists()
