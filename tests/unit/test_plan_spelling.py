"""`meshlm plan` reads the job in meshlm train's keys; its old spellings are aliases that name the new one once,
and a train key the planner does not price is refused by name."""

from __future__ import annotations

import pytest

from meshlm.cli import main

SHAPE = ["--gpus-per-node", "4", "--strategy", "ddp,zero3", "--json"]
OLD = ["--model", "tiny", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--mlp", "128"]
OLD += ["--tp", "2", "--precision", "fp32", "--cp-attention", "ring", "--attention", "fused"]
NEW = ["--model-name", "tiny", "--arch.layers", "2", "--arch.hidden-size", "64", "--arch.heads", "4"]
NEW += ["--arch.kv-heads", "2", "--arch.intermediate-size", "128", "--parallel.tp", "2", "--mixed-precision", "no"]
NEW += ["--parallel.cp-attention", "ring", "--attention", "auto"]


def _plan(argv: list[str], capsys) -> tuple[str, list[str]]:
    with pytest.raises(SystemExit) as done:
        main(["plan", *argv])
    out = capsys.readouterr()
    assert done.value.code in (0, None), out.err
    return out.out, out.err.splitlines()


def test_old_and_new_spellings_plan_the_same(capsys):
    new, quiet = _plan(NEW + SHAPE, capsys)
    old, notes = _plan(OLD + SHAPE + ["--tp", "2"], capsys)  # given twice, said once
    assert old == new and '"precision": "fp32"' in new and '"cp_attention": "ring"' in new
    assert quiet == []
    assert notes == [
        "meshlm: note: --model is now --model-name",
        "meshlm: note: --layers is now --arch.layers",
        "meshlm: note: --hidden is now --arch.hidden-size",
        "meshlm: note: --heads is now --arch.heads",
        "meshlm: note: --kv-heads is now --arch.kv-heads",
        "meshlm: note: --mlp is now --arch.intermediate-size",
        "meshlm: note: --tp is now --parallel.tp",
        "meshlm: note: --precision fp32 is now --mixed-precision no",
        "meshlm: note: --cp-attention is now --parallel.cp-attention",
        "meshlm: note: --attention fused is now --attention auto",
    ]


@pytest.mark.parametrize(
    "argv,key", [(["--objective", "dpo", "--dpo.beta", "0.2"], "--dpo.beta"), (["--lr", "1e-4"], "--lr")]
)
def test_a_train_key_the_planner_does_not_price_is_refused(argv, key, capsys):
    with pytest.raises(SystemExit) as bad:
        main(["plan", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert bad.value.code == 2 and len(err) == 1
    assert err[0].startswith(f"meshlm: error: {key} is a meshlm train option the planner does not price"), err
