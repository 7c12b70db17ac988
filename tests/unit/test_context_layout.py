"""Context parallel in the layout, in this process: the cp dimension's degrees, which strategy auto picks, how
gradients average (dp x cp), the scheme each head count gets, and the one-line errors before any rank starts."""

from __future__ import annotations

import re

import pytest

from meshlm import config, verify
from meshlm.errors import MeshlmError
from meshlm.layout import Degrees, Layout, degrees, resolve, strategy_for
from meshlm.models.build import model_config
from meshlm.parallel.context import scheme_for


def _cfg(**keys):
    base = {"arch.heads": 8, "arch.kv_heads": 4, "seq_length": 64}
    return config.load(None, [(k, str(v)) for k, v in {**base, **keys}.items()])


def test_degrees_with_cp():
    assert degrees("fsdp", 8, cp=2, tp=2) == Degrees(dp_shard=2, cp=2, tp=2)
    assert degrees("ddp", 8, cp=4) == Degrees(dp_replicate=2, cp=4)
    assert degrees("hsdp", 8, cp=2, shard_size=2) == Degrees(dp_replicate=2, dp_shard=2, cp=2)
    assert Degrees(dp_shard=2, cp=2, tp=2).world == 8 and Degrees(dp_replicate=2, cp=4).dp_cp == 8
    assert strategy_for("auto", 2, cp=2) == "fsdp"  # the cp ranks shard the states as well (torchtitan)
    assert strategy_for("auto", 2, tp=2) == "ddp"  # tensor parallel alone: nothing to shard over


def test_gradients_average_over_dp_and_cp():
    cp_alone = Layout("ddp", degrees("ddp", 2, cp=2))
    assert cp_alone.dp == 1 and cp_alone.averages and cp_alone.replicated and cp_alone.engine == "ddp"
    fsdp = Layout("fsdp", degrees("fsdp", 2, cp=2))
    assert fsdp.sharded and fsdp.engine == "fsdp"
    assert Layout("fsdp", degrees("fsdp", 4, pp=2, cp=2)).sharded  # pipeline stages shard over their cp ranks
    # bf16 zero2 on cp ranks: FSDP (the fp32-masters engine reduces over data-parallel ranks only)
    assert Layout("zero2", degrees("zero2", 4, cp=2), "bf16").engine == "fsdp"
    assert "cp=2" in fsdp.describe() and ("parallel.cp", "2") in fsdp.keys()
    assert resolve(config.load(None, config.parse_args(fsdp.to_args())), 2, model_config(_cfg())) == fsdp


@pytest.mark.parametrize(
    "heads, kv, cp, want",
    [
        (8, 4, 2, "ulysses"),
        (8, 4, 4, "ulysses"),
        (8, 2, 4, "ring"),
        (4, 2, 8, "ring"),
        (6, 6, 4, "ring"),
    ],
)
def test_scheme(heads, kv, cp, want):
    assert scheme_for("auto", heads, kv, cp) == want


@pytest.mark.parametrize(
    "world, keys, message",
    [
        (3, {"parallel.cp": 2}, "world size 3 is not divisible by tp x pp x cp = 1 x 1 x 2"),
        (2, {"parallel.cp": 2, "seq_length": 63}, "--seq-length 63 is not a multiple of 2"),
        (
            4,
            {"parallel.cp": 4, "arch.kv_heads": 2, "seq_length": 36},
            "into 8 zig-zag chunks (attention by ring); --seq-length 36 is not a multiple of 8",
        ),
        (
            4,
            {"parallel.cp": 4, "arch.kv_heads": 2, "parallel.cp_attention": "ulysses"},
            "a tensor-parallel rank has 8 heads and 2 key/value heads: pick a cp dividing both",
        ),
        (
            8,
            {"parallel.cp": 4, "parallel.tp": 2, "parallel.cp_attention": "ulysses"},
            "a tensor-parallel rank has 4 heads and 2 key/value heads",
        ),
        (4, {"parallel.cp": 2, "parallel.tp": 2, "strategy": "ddp"}, "with 2 data- and context-parallel ranks"),
        (2, {"parallel.cp": 2, "strategy": "dp"}, "--strategy dp runs in one process"),
        (2, {"chunked_loss": "lots"}, "--chunked-loss must be auto, on, off or a number of tokens per chunk"),
    ],
)
def test_cp_errors(world, keys, message):
    with pytest.raises(MeshlmError, match=re.escape(message)):
        cfg = _cfg(**keys)
        resolve(cfg, world, model_config(cfg))


def test_verify_runs_the_cp_layouts():
    cfg = config.load(None, config.parse_args(verify.PRESETS["tiny"]))
    cases = {c.name: c for c in verify.layouts(4, 0) if "cp" in c.name}
    assert set(cases) == {"cp", "ddp+cp", "fsdp+cp", "tp+cp", "pp+cp"}
    for case in cases.values():
        assert verify.unavailable(case, cfg, 8) == "", case
        assert case.layout.cp == (4 if case.name == "cp" else 2) and case.layout.world == 4


def _groups(rank: int, d: Degrees) -> dict[str, set[int]]:
    """The ranks of each of `rank`'s mesh groups under degrees `d` (a fake process group: no other process)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlm.layout import build_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=d.world)
    try:
        mesh = build_mesh("cpu", d)
        names = ("dp", "cp", "dp_cp", "dp_shard_cp", "experts", "efsdp")
        return {n: set(mesh[n].mesh.flatten().tolist()) for n in names}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 5])
def test_expert_parallel_with_cp_mesh(rank):
    """ep 2 x cp 2 on 8 ranks (dp_shard 4): an expert group's ranks share their cp coordinate (each cp rank
    dispatches its own tokens), the cp ranks join the experts' FSDP shards (efsdp 2 x cp 2), and everything
    averages and shards over dp x cp."""
    d = degrees("fsdp", 8, cp=2, ep=2)
    assert d == Degrees(dp_shard=4, cp=2, ep=2)
    g = _groups(rank, d)
    assert len(g["experts"]) == 2 and g["experts"] & g["cp"] == {rank} and g["experts"] <= g["dp"]
    assert len(g["efsdp"]) == 4 and g["cp"] <= g["efsdp"] and g["efsdp"] & g["experts"] == {rank}
    assert len(g["dp"]) == 4 and g["dp"] & g["cp"] == {rank}
    assert g["dp_cp"] == g["dp_shard_cp"] == set(range(8))


def test_verify_runs_expert_parallel_with_cp(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    cfg = config.load(None, [("model_name", str(tmp_path)), ("seq_length", "32")])
    case = {c.name: c for c in verify.layouts(4, 0, experts=True)}["ep+cp"]
    assert verify.unavailable(case, cfg, 8) == ""
    assert case.layout.degrees == Degrees(dp_shard=2, cp=2, ep=2)
    assert "ep+cp" in {c.name for c in verify.layouts(8, 0, experts=True)}
    assert "ep+cp" not in {c.name for c in verify.layouts(2, 0, experts=True)}
