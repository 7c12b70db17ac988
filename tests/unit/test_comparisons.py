"""The comparisons parity rests on (meshlm verify, the suite's assert_close, gpu-check's worst): a NaN fails them
wherever it sits, and a LoRA adapter that did not train differs by its whole update."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close
from helpers.bench import script
from meshlm import verify

gpu_check_jobs = script("gpu_check_jobs")

NAN = math.nan


@pytest.mark.parametrize("got", [[1.0, NAN, 3.0], [1.0, 2.0, NAN], [NAN, 2.0, 3.0], [1.0, 2.0, math.inf]])
def test_a_nan_or_inf_anywhere_fails(got):
    want = [1.0, 2.0, 3.0]
    assert not verify.max_rel(got, want) <= 1.0  # NaN or inf: fails any tolerance
    assert not verify.max_rel(want, got) <= 1.0
    assert not gpu_check_jobs.worst(got, want) < 1.0
    with pytest.raises(AssertionError):
        assert_close(got, want, 1e-5)
    with pytest.raises(AssertionError):
        assert_close(want, got, 1e-5)


def test_equal_lists_pass_and_lengths_must_match():
    assert verify.max_rel([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert math.isnan(verify.max_rel([1.0, 2.0], [1.0]))
    assert_close([1.0, 2.0], [1.0, 2.0 * (1 + 1e-6)], 1e-5)


def _rows(losses: list[float]) -> list[dict]:
    return [{"step": i + 1, "loss": x, "grad_norm": 1.0, "model_state_bytes": 100} for i, x in enumerate(losses)]


def test_verify_fails_a_nan_in_the_third_step():
    params = {"w": torch.ones(3)}
    ref = _rows([3.0, 2.5, 2.0, 1.5])
    case, tol = verify.Case("ddp", 2, "ddp"), verify.TOLERANCE
    assert verify.compare(verify.Row("ddp", 2), ref, ref, params, params, case, tol).status == "ok"
    row = verify.compare(verify.Row("ddp", 2), ref, _rows([3.0, 2.5, NAN, 1.5]), params, params, case, tol)
    assert row.status == "FAIL" and "loss difference nan > 0.0001" in row.problems, row.problems
    nan_param = {"w": torch.tensor([1.0, NAN, 1.0])}
    row = verify.compare(verify.Row("ddp", 2), ref, ref, params, nan_param, case, tol)
    assert row.status == "FAIL" and any(p.startswith("params difference nan") for p in row.problems), row.problems


def test_param_diff_measures_against_the_update():
    """A (Kaiming, ~0.1) moved by 1e-3 in the reference: the layout that skipped A's update differs by 1 (all of
    the update), not by 1e-2 (the update over A's size); B starts at zero, so for it the two are the same."""
    a0 = torch.full((4, 4), 0.1)
    ref = {"x.lora_A.default.weight": a0 + 1e-3, "x.lora_B.default.weight": torch.full((4, 4), 2e-3)}
    skipped_a = {**ref, "x.lora_A.default.weight": a0.clone()}

    def start(name, like):
        return a0 if ".lora_A." in name else torch.zeros_like(like)

    assert verify.param_diff(ref, skipped_a)[0] == pytest.approx(1e-3 / 0.101, rel=1e-3)  # by size: fooled
    assert verify.param_diff(ref, skipped_a, start)[0] == pytest.approx(1.0, rel=1e-3)
    assert verify.param_diff(ref, {k: v.clone() for k, v in ref.items()}, start) == (0.0, "")


def test_the_benchmarks_ask_verify_which_layouts_run():
    """benchmarks/harness.available (vs_accelerate, overhead, scaling) through verify's own check: '' for a layout
    this tree runs, one reason for one it cannot."""
    harness = script("harness")

    assert harness.available("ddp", 2) == ""
    assert harness.available("tp", 2, tp=2) == ""
    assert harness.available("ddp", 2, global_batch=3)  # 3 records do not split over 2 ranks
