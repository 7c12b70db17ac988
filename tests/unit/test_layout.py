"""The config, the resolved layout and the launch options, in this process: coercion of values, degrees for a
rank count, every layout check's one-line error, the to_args/parse_args round trip, launch checks and the
stripping of launch flags."""

from __future__ import annotations

import re

import pytest

from meshlm import config
from meshlm.errors import MeshlmError
from meshlm.launch import LaunchOptions, check
from meshlm.layout import Degrees, Layout, degrees, resolve, strategy_for
from meshlm.options import launch_flags_in, parse_train, strip_launch_flags


@pytest.mark.parametrize(
    "typ, value, want",
    [
        (bool, "yes", True),
        (bool, "0", False),
        (bool, True, True),
        (int, "12", 12),
        (int, 3.0, 3),
        (float, "1e-3", 1e-3),
        (float, 2, 2.0),
        (str, 5, "5"),
    ],
)
def test_coerce(typ, value, want):
    assert config.coerce("k", value, typ) == want


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("max_steps", "ten", "--max-steps needs an integer, got 'ten'"),
        ("max_steps", 2.5, "--max-steps needs an integer"),
        ("max_steps", True, "--max-steps needs an integer"),
        ("lr", "fast", "--lr needs a number"),
        ("resume", "maybe", "--resume needs true or false"),
        ("strategy", "zero9", "--strategy must be one of auto, single"),
        ("parallel.tpp", "2", "unknown config key 'parallel.tpp'; see `meshlm train --help`"),
        ("tp", "2", "unknown config key 'tp' (did you mean --parallel.tp"),
    ],
)
def test_bad_keys_and_values(key, value, message):
    with pytest.raises(MeshlmError, match=re.escape(message)):
        config.set_key(config.Config(), key, value)


def test_toml_overrides_and_validation(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("max_steps = 7\n[parallel]\ntp = 2\n")
    cfg = config.load(str(toml), [("max_steps", "9")])
    assert (cfg.max_steps, cfg.parallel.tp) == (9, 2)  # the command line wins over the file
    with pytest.raises(MeshlmError, match="--grad-accum must be at least 1"):
        config.load(None, [("grad_accum", "0")])


def test_args_round_trip():
    keys = [("parallel.shard_size", "2"), ("seq_length", "64")]
    assert config.to_args(keys) == ["--parallel.shard-size", "2", "--seq-length", "64"]
    assert config.parse_args(config.to_args(keys)) == keys
    lay = Layout("hsdp", Degrees(pp=1, dp_replicate=2, dp_shard=2, tp=1))
    cfg = config.load(None, config.parse_args(lay.to_args()))
    assert resolve(cfg, 4) == lay
    with pytest.raises(MeshlmError, match="--key value pairs"):
        config.parse_args(["--seq-length"])


@pytest.mark.parametrize(
    "strategy, world, tp, pp, want",
    [
        ("auto", 1, 1, 1, "single"),
        ("auto", 4, 1, 1, "ddp"),
        ("auto", 4, 2, 1, "fsdp"),
        ("auto", 2, 2, 1, "ddp"),
        ("auto", 4, 2, 2, "ddp"),
        ("zero1", 4, 1, 1, "zero1"),
    ],
)
def test_auto_strategy(strategy, world, tp, pp, want):
    assert strategy_for(strategy, world, tp, pp) == want


def test_degrees_and_predicates():
    assert degrees("ddp", 8, tp=2) == Degrees(pp=1, dp_replicate=4, dp_shard=1, tp=2)
    assert degrees("zero3", 8, pp=2) == Degrees(pp=2, dp_replicate=1, dp_shard=4, tp=1)
    assert degrees("hsdp", 8, shard_size=2) == Degrees(pp=1, dp_replicate=4, dp_shard=2, tp=1)
    assert degrees("hsdp", 8) == Degrees(
        pp=1, dp_replicate=1, dp_shard=8, tp=1
    )  # shard size 0: all data-parallel ranks
    fsdp_tp = Layout("fsdp", degrees("fsdp", 8, tp=2))
    assert fsdp_tp.sharded and fsdp_tp.tp_enabled and not fsdp_tp.pp_enabled and fsdp_tp.dp == 4
    assert fsdp_tp.world == 8 and fsdp_tp.shards_state and not fsdp_tp.replicated
    ddp = Layout("ddp", degrees("ddp", 2))
    assert ddp.replicated and not ddp.sharded and not ddp.shards_state
    assert not Layout("ddp", degrees("ddp", 2, tp=2)).replicated  # tensor parallel alone: nothing to replicate


@pytest.mark.parametrize(
    "world, keys, message",
    [
        (4, {"strategy": "single"}, "--strategy single runs in one process; drop --nproc 4"),
        (3, {"parallel.tp": 2}, "world size 3 is not divisible by tp x pp = 2 x 1"),
        (6, {"strategy": "hsdp", "parallel.shard_size": 4}, "--parallel.shard-size 4 does not divide the 6"),
        (2, {"cpu_offload": True, "strategy": "ddp"}, "--cpu-offload works with --strategy zero2/zero3/fsdp/hsdp"),
        (1, {"strategy": "dp", "compile": True}, "does not combine with --compile"),
    ],
)
def test_layout_errors(world, keys, message):
    cfg = config.load(None, [(k, str(v)) for k, v in keys.items()])
    with pytest.raises(MeshlmError, match=re.escape(message)):
        resolve(cfg, world)


def test_resolve_reads_the_model_only_when_needed():
    cfg = config.load(None, [("model_name", "/no/such/model")])
    assert resolve(cfg, 2) == Layout("ddp", Degrees(dp_replicate=2))  # no tp/pp: the model is not read
    tp = config.load(None, [("model_name", "/no/such/model"), ("parallel.tp", "2")])
    with pytest.raises(MeshlmError, match="does not exist"):
        resolve(tp, 2)


def test_strip_launch_flags():
    argv = ["--nproc", "2", "--max-steps", "5", "--nnodes=2", "--rdzv-endpoint", "h:1", "--omp-threads", "1", "-x"]
    assert strip_launch_flags(argv) == ["--max-steps", "5", "-x"]
    assert launch_flags_in(argv) == ["--nnodes", "--nproc", "--omp-threads", "--rdzv-endpoint"]
    ns, cfg = parse_train(argv[:4])
    assert ns.nproc == 2 and cfg.max_steps == 5


@pytest.mark.parametrize(
    "opts, message",
    [
        (LaunchOptions(nproc=0), "--nproc must be at least 1, got 0"),
        (LaunchOptions(nnodes=0), "--nnodes must be at least 1, got 0"),
        (LaunchOptions(nnodes=2, node_rank=2), "--node-rank 2 is outside 0..1"),
        (LaunchOptions(max_restarts=-1), "must not be negative"),
        (LaunchOptions(nnodes=2), "--nnodes > 1 needs --rdzv-endpoint"),
        (LaunchOptions(rdzv_endpoint="host:99999"), "--rdzv-endpoint must be HOST:PORT"),
    ],
)
def test_launch_checks(opts, message):
    with pytest.raises(MeshlmError, match=re.escape(message)):
        check(opts)


def test_launch_endpoint():
    assert check(LaunchOptions()) == ("127.0.0.1", 0)
    assert check(LaunchOptions(nnodes=2, rdzv_endpoint="[::1]:29400")) == ("::1", 29400)


# The engine of every layout `meshlm verify --nproc 4` runs, and of the bf16/offload variants that change it:
# named by layout.resolve alone (parallel/apply.py builds what Layout.engine says).
VERIFY_ENGINES = {
    "dp": "dp",
    "layer-split": "layer-split",
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "fsdp",
    "zero3": "fsdp",
    "fsdp": "fsdp",
    "hsdp": "fsdp",
    "tp": "single",
    "pp-gpipe": "pipeline",
    "pp-1f1b": "pipeline",
    "pp-interleaved": "pipeline",
    "fsdp+tp": "fsdp",
    "ddp+pp": "pipeline",
    "fsdp+pp": "pipeline",
    "tp+pp": "pipeline",
    "cp": "fsdp",  # cp ranks shard the states (auto: fsdp)
    "ddp+cp": "ddp",
    "fsdp+cp": "fsdp",
    "tp+cp": "fsdp",
    "pp+cp": "pipeline",
}
PRECISION_ENGINES = [  # (case, --mixed-precision, --cpu-offload, engine, FSDP runs)
    ("zero1", "bf16", False, "masters", False),
    ("zero2", "bf16", False, "masters", False),
    ("zero2", "bf16", True, "fsdp", True),
    ("zero3", "bf16", False, "fsdp", True),
    ("ddp", "bf16", False, "ddp", False),
    ("fsdp+tp", "bf16", False, "fsdp", True),
    ("fsdp+pp", "bf16", False, "pipeline", True),
    ("tp+pp", "no", False, "pipeline", False),
]


def _resolved(case, precision: str = "no", offload: bool = False) -> Layout:
    from meshlm import verify

    cfg = config.load(None, config.parse_args(verify.PRESETS["tiny"]))
    for k, v in [*case.keys(8, 1), ("mixed_precision", precision), ("cpu_offload", offload)]:
        config.set_key(cfg, k, v)
    return resolve(cfg, max(1, case.nproc))


def test_resolve_names_the_engine_of_every_verify_layout():
    from meshlm import verify

    cases = {c.name: c for c in verify.layouts(4, 0)}
    assert {name: _resolved(c).engine for name, c in cases.items()} == VERIFY_ENGINES
    for name, precision, offload, engine, fsdp in PRECISION_ENGINES:
        layout = _resolved(cases[name], precision, offload)
        assert (layout.engine, layout.sharded) == (engine, fsdp), (name, precision, offload)
    assert resolve(config.Config(), 1).engine == "single"


def test_the_planner_reads_the_engine_and_the_rules_resolve_uses():
    """plan/memory.py's master-weight question is Layout.engine's answer; the advisor's candidates are the
    compositions resolve accepts (layout.composition_error), on a 2-node cluster."""
    from meshlm.layout import composition_error
    from meshlm.plan import advisor
    from meshlm.plan.cluster import make_cluster
    from meshlm.plan.job import Job
    from meshlm.plan.memory import master_weights
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    for strategy in ("ddp", "zero1", "zero2", "zero3", "hsdp"):
        for precision, tp, pp, dp, offload in [
            ("bf16", 1, 1, 4, False),
            ("fp32", 1, 1, 4, False),
            ("bf16", 2, 1, 4, False),
            ("bf16", 1, 2, 4, False),
            ("bf16", 1, 1, 1, False),
            ("bf16", 1, 1, 4, True),
        ]:
            job = Job(precision=precision)
            planned = master_weights(strategy, job, StageShape(4, True, True, 1, tp), dp, pp > 1, offload)
            run = Layout(strategy, Degrees(pp, dp, 1, tp), "bf16" if precision == "bf16" else "no", offload)
            assert planned == (run.engine == "masters"), (strategy, precision, tp, pp, dp, offload)
    spec = load_model("llama-7b")
    cluster = make_cluster(nodes=2, gpus_per_node=4)
    cands = advisor.candidates(spec, cluster)
    assert cands and not [c for c in cands if composition_error(c.layout)]
    kept = {(c.strategy, c.dp, c.tp, c.pp) for c in cands}
    assert ("ddp", 4, 2, 1) not in kept and ("zero1", 4, 1, 2) not in kept and ("zero3", 4, 2, 1) in kept


def test_generate_modes_as_layouts():
    assert Layout.for_inference("dp", 4).degrees == Degrees(dp_replicate=4)
    tp = Layout.for_inference("tp", 4)
    assert tp.degrees == Degrees(tp=4) and tp.engine == "single" and tp.world == 4
    assert Layout.for_inference("pp", 2).degrees == Degrees(pp=2)
    assert Layout.for_inference("tp", 1) == Layout("single")
    assert Layout.for_inference("layer-split", 1).engine == "layer-split"


@pytest.mark.parametrize(
    "strategy,degrees,words",
    [
        ("single", Degrees(), "one process, no parallelism"),
        ("ddp", Degrees(tp=2), "tensor parallel 2"),  # one replica: nothing data-parallel runs
        ("ddp", Degrees(dp_replicate=4), "data parallel (DDP) 4"),
        ("zero3", Degrees(dp_shard=2, tp=2), "ZeRO-3 sharded data parallel 2 x tensor parallel 2"),
        ("hsdp", Degrees(dp_replicate=2, dp_shard=2), "hybrid sharded data parallel (replicas x shards) 2x2"),
        ("ddp", Degrees(pp=2, cp=2), "pipeline parallel 2 x context parallel 2"),
        ("zero3", Degrees(), "ZeRO-3 sharded data parallel 1"),  # FSDP on one rank (offload) still runs
    ],
)
def test_a_layout_is_named_by_what_runs(strategy, degrees, words):
    assert Layout(strategy, degrees).in_words() == words
