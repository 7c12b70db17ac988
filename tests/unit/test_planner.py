"""`meshlm plan` in this process: the accounting (arithmetic), the activation model against what transformers'
modules really keep (measured here), the advisor and its command line, bad input. The real multi-rank
`--validate` run is tests/test_plan.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import shlex
import subprocess
import sys

import pytest
import torch

from meshlm import config as config_mod
from meshlm.cli import build_parser, main
from meshlm.errors import MeshlmError
from meshlm.options import overrides
from meshlm.plan import advisor
from meshlm.plan.activations import layer_activation_bytes
from meshlm.plan.advisor import Candidate
from meshlm.plan.cluster import make_cluster, parse_bandwidth, parse_flops, parse_size
from meshlm.plan.comm import collectives
from meshlm.plan.job import Job
from meshlm.plan.memory import memory, startup_part
from meshlm.plan.shape import Dtypes, StageShape
from meshlm.plan.spec import from_hf_config, hf_config_from_dims, load_model
from meshlm.train.probe import _memory_tracker

GiB = 2**30
TINY_DIMS = [
    "--arch.layers",
    "2",
    "--arch.hidden-size",
    "64",
    "--arch.heads",
    "4",
    "--arch.kv-heads",
    "2",
    "--arch.intermediate-size",
    "128",
]


def test_sizes_rates_and_flops_parse():
    assert parse_size("--gpu-memory", "80GiB") == 80 * GiB
    assert parse_size("--gpu-memory", "80GB") == 80 * 10**9
    assert parse_size("--gpu-memory", "80e9") == 80 * 10**9
    assert parse_size("--gpu-memory", "1.5 TiB") == int(1.5 * 2**40)
    assert parse_bandwidth("--inter-node", "400Gb/s")[0] == 50e9
    assert parse_bandwidth("--inter-node", "50GB/s")[0] == 50e9
    assert parse_bandwidth("--inter-node", "nvlink")[0] == 300e9
    assert parse_flops("--peak-flops", "989T") == 989e12
    for bad in ("eighty", "80 parsecs", "-5GB", ""):
        with pytest.raises(MeshlmError, match="80GiB"):
            parse_size("--gpu-memory", bad)


def test_presets_count_the_real_parameter_numbers():
    """Counted on the meta device: the published sizes of Llama-2 7B / 70B and GPT-2."""
    assert load_model("llama-7b").params == 6_738_415_616
    assert load_model("llama-70b").params == 68_976_648_192
    assert load_model("gpt2").params == 124_439_808


def _states(spec, job, strategy, dp, shard, offload=False):
    m = memory(spec, job, StageShape(spec.layers, True, True, 1, 1), strategy, dp, shard, 1, False, offload)
    return sum(m.states.values()), m


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_states_follow_the_zero_paper(precision):
    """ZeRO accounting with meshlm's widths: ddp 16 (fp32 masters are the parameters: 4+4+8, the paper's
    2+2+12), zero3 16/N, hsdp 16/K, offload 0; zero1 and zero2 in fp32 4+4+8/N and 4+12/N, under bf16 the
    paper's own 2+2+12/N and 2+14/N (engines/master_weights.py)."""
    spec, n = load_model("llama-7b"), 8
    psi = spec.params
    job = Job(seq_length=2048, precision=precision)
    assert _states(spec, job, "ddp", n, 1)[0] == 16 * psi
    if precision == "bf16":
        assert _states(spec, job, "zero1", n, n)[0] == pytest.approx(4 * psi + 12 * psi / n, abs=1)
        total, m = _states(spec, job, "zero2", n, n)
        assert total == pytest.approx(2 * psi + 14 * psi / n, abs=3)
        assert not m.temp.get("ddp gradient buckets") and "autocast bf16 weights" not in m.act.parts
    else:
        assert _states(spec, job, "zero1", n, n)[0] == 8 * psi + 8 * psi // n
        total, m = _states(spec, job, "zero2", n, n)
        assert total == pytest.approx(4 * psi + 12 * psi / n, abs=3)
        assert m.temp["fp32 parameter shards"] == pytest.approx(4 * psi / n, abs=1)
    assert _states(spec, job, "zero3", n, n)[0] == pytest.approx(16 * psi / n, abs=3)
    assert _states(spec, job, "hsdp", n, 4)[0] == pytest.approx(16 * psi / 4, abs=3)
    total, m = _states(spec, job, "zero3", n, n, offload=True)
    assert total == 0 and m.cpu == pytest.approx(16 * psi / n, abs=3)
    assert _states(spec, Job(precision=precision, optimizer="sgd"), "ddp", n, 1)[0] == 12 * psi
    # DDP's buckets are the gradients (gradient_as_bucket_view); autocast's bf16 weight cache is on top
    m = _states(spec, job, "ddp", n, 1)[1]
    assert not m.temp.get("ddp gradient buckets")
    assert ("autocast bf16 weights" in m.act.parts) == (precision == "bf16")


def test_communication_volumes():
    spec, n = load_model("llama-7b"), 8
    cluster = make_cluster(1, n)
    job = Job(seq_length=2048, precision="fp32", micro_batch=1)
    stage = StageShape(spec.layers, True, True, 1, 1)

    def comm(strategy, shard=n, tp=1, stg=stage, pp=1, micro=1):
        return collectives(spec, job, cluster, strategy, n // (tp * pp), shard, tp, pp, stg, 0, micro, False)

    ddp = {c.kind: c for c in comm("ddp", 1)}
    grad_bytes = 4 * spec.params
    assert ddp["all_reduce"].payload == grad_bytes
    assert ddp["all_reduce"].wire == pytest.approx(2 * (n - 1) / n * grad_bytes)  # ring all-reduce
    zero3 = sum(c.wire for c in comm("zero3"))
    # gather fwd + gather bwd + reduce-scatter, less the untied embedding's backward gather (parallel/fsdp.py)
    embed_gather = (n - 1) / n * 4 * spec.vocab * spec.hidden
    assert zero3 == pytest.approx(1.5 * ddp["all_reduce"].wire - embed_gather)
    hsdp = {c.kind: c for c in comm("hsdp", shard=4)}
    assert hsdp["all_reduce"].payload == grad_bytes // 4 and hsdp["all_reduce"].ranks == 2
    assert hsdp["all_gather"].ranks == 4
    # TP: Megatron's 4 all-reduces per block (2 forward, 2 backward: q/k/v and gate/up share their input's)
    tp_stage = StageShape(spec.layers, True, True, 1, 2)
    tp = [c for c in comm("ddp", 1, tp=2, stg=tp_stage) if c.group == "tp"]
    # blocks, then the vocabulary-parallel embedding, head and loss (loss_parallel: no logits gather)
    assert [c.kind for c in tp] == ["all_reduce", "all_reduce"]
    assert tp[0].calls == 4 * spec.layers
    assert tp[0].payload == 4 * spec.layers * 2048 * spec.hidden * 4
    # PP: a middle stage sends and receives activations and gradients across both boundaries
    mid = StageShape(8, False, False, 2, 1)
    p2p = [c for c in comm("ddp", 1, stg=mid, pp=4, micro=8) if c.kind == "p2p"][0]
    assert p2p.payload == 8 * 2 * 2 * 2048 * spec.hidden * 4
    assert p2p.wire == p2p.payload / 2


def _measure(family, attention, precision, ac, fsdp_bf16):
    """Peak activation memory of one real training step of a tiny transformers model (MemTracker), and the
    bytes each block saves for backward (saved-tensor hooks)."""
    h, L, a, kv, mlp, vocab, s, b = 64, 2, 4, 2, 128, 320, 32, 4
    c = hf_config_from_dims(family, L, h, a, kv if family == "llama" else a, mlp, vocab, 1024)
    torch.manual_seed(0)
    model = __import__("transformers").AutoModelForCausalLM.from_config(
        c, dtype=torch.float32, attn_implementation="sdpa" if attention == "fused" else "eager"
    )
    blocks = model.model.layers if family == "llama" else model.transformer.h
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(L):
            blocks[i] = checkpoint_wrapper(blocks[i])
    if fsdp_bf16:
        model = model.to(torch.bfloat16)  # what FSDP2's MixedPrecisionPolicy computes with
    ids = torch.randint(0, vocab, (b, s))
    opt = torch.optim.AdamW(model.parameters())
    autocast = lambda: torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()  # noqa

    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # block 1 alone: what one block keeps
        x = torch.randn(b, s, h, requires_grad=True, dtype=torch.bfloat16 if fsdp_bf16 else torch.float32)
        with autocast():
            pos = model.model.rotary_emb(x, torch.arange(s)[None]) if family == "llama" else None
            (blocks[1](x, position_embeddings=pos) if family == "llama" else blocks[1](x))
    for _ in range(2):  # the second step is the measured one (optimizer states exist)
        tracker = _memory_tracker(model, opt) if _ else contextlib.nullcontext()
        with tracker:
            with autocast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
    spec = from_hf_config("t", c)
    # transformers' own loss over the whole logits (model(labels=...)), not meshlm's fused head
    job = Job(seq_length=s, micro_batch=b, precision=precision, attention=attention, chunked_loss="off")
    strategy = "zero3" if fsdp_bf16 else "single"
    predicted = memory(spec, job, StageShape(L, True, True, 1, 1), strategy, 1, 1, b, ac, False).act
    block = layer_activation_bytes(spec, job, b * s, 1, Dtypes.of(job, fsdp_bf16))
    cos_sin = 2 * (2 if fsdp_bf16 else 4) * s * spec.head_dim if family == "llama" else 0
    return tracker.step_peak()[0], predicted.peak, sum(saved.values()) - cos_sin, sum(block.values())


@pytest.mark.parametrize(
    "family,attention,precision,ac,fsdp_bf16",
    [
        ("llama", "fused", "fp32", False, False),
        ("llama", "fused", "bf16", True, False),
        ("llama", "eager", "bf16", False, True),
        ("gpt2", "fused", "fp32", True, False),
        ("gpt2", "eager", "fp32", False, False),
        ("gpt2", "fused", "bf16", False, True),
    ],
)
def test_activation_model_matches_what_transformers_keeps(family, attention, precision, ac, fsdp_bf16):
    """Per block the formula is exact (it lists what each op saves); the step's peak within 10%
    (the transients around the loss and one block's backward are modelled, not listed)."""
    measured_peak, predicted_peak, measured_block, predicted_block = _measure(
        family, attention, precision, ac, fsdp_bf16
    )
    if not ac:
        assert predicted_block == measured_block
    assert predicted_peak == pytest.approx(measured_peak, rel=0.10)


def _plan(*args):
    ns = build_parser().parse_args(["plan", *args])
    from meshlm.plan.cli import inputs

    spec, cluster, job, layouts = inputs(ns)
    return advisor.plan(spec, job, cluster, layouts, ns.efficiency)


def _assert_runnable(cmd):
    """The winner's command line uses meshlm train's real options and values."""
    assert cmd[:2] == ["meshlm", "train"]
    ns = build_parser().parse_args(cmd[1:])
    return config_mod.load(None, overrides(ns))


def test_advisor_follows_the_decision_guide():
    small = _plan(*TINY_DIMS, "--gpus-per-node", "2", "--seq-length", "64", "--micro-batch-size", "8")
    assert small.ranked[0].candidate == Candidate("ddp", 2)
    assert "fits on each GPU" in small.reasons[0]
    cfg = _assert_runnable(small.command)
    assert (cfg.strategy, cfg.arch.hidden_size, cfg.micro_batch_size) == ("ddp", 64, 8)

    seven = _plan("--model-name", "llama-7b")  # 8 x H100, bf16: 16 bytes x 6.7B replicated do not fit
    assert seven.ranked[0].candidate.strategy in ("zero2", "zero3", "hsdp")
    assert "must be sharded" in seven.reasons[0]
    cfg = _assert_runnable(seven.command)
    assert cfg.model_name == "NousResearch/Llama-2-7b-hf" and cfg.mixed_precision == "bf16"
    assert [e.step_s for e in seven.ranked[:3]] == sorted(e.step_s for e in seven.ranked[:3])

    huge = _plan("--model-name", "llama-70b")  # one node: even /8 the states exceed 80 GiB -> offload
    assert huge.ranked[0].candidate.offload and any("CPU offload" in r for r in huge.reasons)
    assert _assert_runnable(huge.command).cpu_offload

    slow = _plan("--model-name", "llama-13b", "--nodes", "2", "--inter-node", "ethernet", "--global-batch-size", "32")
    lay = slow.ranked[0].candidate
    assert lay.strategy == "hsdp" or lay.pp > 1
    assert any("slower than inside a node" in r for r in slow.reasons)
    cfg = _assert_runnable(slow.command)
    assert cfg.parallel.pp == lay.pp

    wide = _plan(
        "--gpu-memory",
        "24GiB",
        "--arch.layers",
        "4",
        "--arch.hidden-size",
        "16384",
        "--arch.heads",
        "32",
        "--arch.kv-heads",
        "8",
        "--arch.intermediate-size",
        "65536",
        "--vocab",
        "32000",
        "--arch.max-positions",
        "4096",
    )
    assert wide.ranked[0].candidate.tp > 1 and any("single transformer block" in r for r in wide.reasons)

    none = _plan("--model-name", "llama-70b", "--gpus-per-node", "1")
    assert not none.ranked and none.reasons[0].startswith("nothing fits")


def test_json_and_table(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model-name", "gpt2", "--gpus-per-node", "4", "--json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    top = out["recommendation"]
    assert top["layout"] == out["layouts"][0]["layout"] and len(top["top3"]) == 3
    row = out["layouts"][0]
    assert (
        row["fits"]
        and row["gpu_bytes"] == sum(row["states"].values()) + sum(row["temp"].values()) + row["activations"]["peak"]
    )
    assert shlex.split(top["command"])[:2] == ["meshlm", "train"]
    with pytest.raises(SystemExit):
        main(["plan", "--model-name", "gpt2", "--gpus-per-node", "4"])
    table = capsys.readouterr().out
    assert "recommendation:" in table and "run it:" in table and top["command"] in table


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpu-memory", "eighty"], "cannot read 'eighty' as a size"),
        (["--parallel.tp", "2", "--parallel.pp", "2", "--dp", "3"], "= 12 GPUs, but the cluster has 8"),
        (["--model-name", "gpt2", "--seq-length", "4096"], "larger than gpt2's 1024 positions"),
        (["--model-name", "./no/such/model"], "does not exist"),
        (["--intra-node", "warp-drive"], "cannot read 'warp-drive'"),
        (["--strategy", "zero4"], "zero4 is not one of"),
        (["--mixed-precision", "fp8"], "--mixed-precision must be one of no, bf16"),
    ],
)
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("meshlm: error:") and message in err[0], err


def test_local_model_directory_is_read_as_config_only(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=512,
    ).save_pretrained(tmp_path)
    result = _plan("--model-name", str(tmp_path), "--gpus-per-node", "2", "--seq-length", "512")
    spec = load_model(str(tmp_path))
    assert spec.params == 4 * spec.layer_params + 2 * 1000 * 256 + 256  # blocks, embedding and head, final norm
    assert _assert_runnable(result.command).model_name == str(tmp_path)


def test_unreadable_model_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model-name", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"{tmp_path}/config.json is not valid JSON" in err[0]


def _drawn(png) -> dict:
    """The numbers plot_memory_bars drew, from the PNG's Description text chunk."""
    from PIL import Image

    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    return json.loads(Image.open(png).text["Description"])


def test_plot_draws_the_tables_layouts(tmp_path, capsys, monkeypatch):
    """--plot: one bar group per layout of the table, stacked by component, adding up to the planned total."""
    with pytest.raises(SystemExit) as e:
        main(
            [
                "plan",
                "--model-name",
                "llama-7b",
                "--gpus-per-node",
                "8",
                "--plot",
                "--json",
                "--output-dir",
                str(tmp_path),
            ]
        )
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plot"] == str(tmp_path / "plan-memory.png")
    drawn = _drawn(out["plot"])
    table = [row for row in out["layouts"] if row["fits"]][:10]  # --top 10
    assert drawn["layouts"] == [row["layout"] for row in table] and len(set(drawn["layouts"])) == 10
    assert drawn["gpu_bytes"] == out["cluster"]["gpu_memory"] == 80 * GiB and not drawn["measured"]
    for row in table:
        bars = drawn["predicted"][row["layout"]]
        assert set(bars) == {"parameters", "gradients", "optimizer", "activations", "buffers"}
        assert sum(bars.values()) == row["gpu_bytes"]
    # nothing fits on one GPU: the leanest layouts are drawn against the line, into the current directory
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan-memory.png").unlink()
    with pytest.raises(SystemExit):
        main(["plan", "--model-name", "llama-70b", "--gpus-per-node", "1", "--plot"])
    assert capsys.readouterr().out.splitlines()[-1] == "plot: plan-memory.png"
    drawn = _drawn(tmp_path / "plan-memory.png")
    assert drawn["layouts"] and all(sum(b.values()) > drawn["gpu_bytes"] for b in drawn["predicted"].values())


def test_start_up_peak_is_counted_and_decides_fit():
    """Meta-device build, then each rank fills its fp32 part one tensor at a time (models/materialize.py): the
    start-up peak is that part plus the largest full tensor drawn beside it; a layout fits only if it fits too."""
    result = _plan("--model-name", "llama-7b")  # 8 x H100
    spec = load_model("llama-7b")
    zero3 = next(e for e in result.estimates if e.candidate.name == "zero3")
    largest = spec.vocab * spec.hidden * 4  # the embedding (or head) matrix
    assert zero3.startup == spec.params * 4 // 8 + largest
    assert zero3.to_dict()["startup_bytes"] == zero3.startup
    ddp = next(e for e in result.estimates if e.candidate.name == "ddp")
    # replicated: the whole model on every rank, then DDP's gradient buckets (fp32, as large)
    assert ddp.startup == spec.params * 4 * 2
    assert zero3.fits and not dataclasses.replace(zero3, startup=zero3.budget + 1).fits


def test_float8_prices_the_block_matmuls_and_tensorwise_gathers():
    """--float8: the blocks' dense projections run at the GPU's float8 peak (the head and attention scores at
    the bf16 one), and under tensorwise FSDP gathers those projections in 1 byte instead of bf16's 2."""
    spec, n = load_model("llama-7b"), 8
    stage = StageShape(spec.layers, True, True, 1, 1)
    proj = spec.layer_matmul  # a dense model: every matrix of a block converts
    assert stage.float8_params(spec, Job(float8="rowwise")) == proj and stage.float8_params(spec, Job()) == 0
    gathered = {f: memory(spec, Job(float8=f), stage, "zero3", n, n, 1, False, False).temp["gathered units"]
                for f in ("off", "rowwise", "tensorwise")}  # fmt: skip
    assert gathered["rowwise"] == gathered["off"]  # rowwise gathers bf16 weights and casts them after
    assert spec.vocab * spec.hidden < spec.layer_params  # a block is the largest unit: two are gathered at once
    assert gathered["off"] - gathered["tensorwise"] == 2 * proj
    one = [
        "--model-name",
        "llama-7b",
        "--strategy",
        "ddp",
        "--parallel.tp",
        "1",
        "--parallel.pp",
        "1",
        "--parallel.cp",
        "1",
    ]
    off, f8 = (
        _plan(*one, "--activation-checkpointing", "none", "--float8", f).estimates[0] for f in ("off", "rowwise")
    )
    cluster = make_cluster()
    assert (cluster.peak_flops, cluster.float8_flops) == (989e12, 1979e12)  # H100, dense
    assert off.micro_batches == 1  # one micro-batch of 2048 tokens per rank and step
    work = 2048 * 6 * proj * spec.layers  # the projections' FLOPs, at efficiency 0.5
    saved = work / (cluster.peak_flops * 0.5) - work / (cluster.float8_flops * 0.5)
    assert off.compute_s - f8.compute_s == pytest.approx(saved, rel=1e-9)
    with pytest.raises(MeshlmError, match="--gpu a100-80gb has none"):
        _plan("--model-name", "llama-7b", "--gpu", "a100-80gb", "--float8", "rowwise")


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_the_optimizer_steps_temporaries_are_planned(impl):
    """What torch's AdamW allocates and frees again inside a step (live bytes, as --simulate counts them): foreach
    (meshlm's for DTensor parameters: FSDP, TP, ep) one fp32 copy of the group's second moments, fused none;
    plan/memory.py counts the copy for exactly the layouts whose parameters are DTensors."""
    from meshlm.plan.live_bytes import LiveBytes
    from meshlm.plan.memory import foreach_adamw_copy

    params = [torch.nn.Parameter(torch.randn(256, 128)), torch.nn.Parameter(torch.randn(64, 128))]
    opt = torch.optim.AdamW(params, lr=1e-3, **{impl: True})
    for _ in range(2):  # the first step creates the states; the second is measured
        for p in params:
            p.grad = torch.randn_like(p)
        resident = [*params, *(p.grad for p in params), *(v for s in opt.state.values() for v in s.values())]
        with LiveBytes(resident) as live:
            opt.step()
    transient, _ = live.transient_peak(("step",))
    numel = sum(p.numel() for p in params)
    assert transient == (foreach_adamw_copy(Job(), numel) if impl == "foreach" else 0)
    spec = from_hf_config("tiny", hf_config_from_dims("llama", 2, 64, 4, 2, 128, 256, 64))
    stage, job = StageShape(2, True, True, 1, 1), Job(seq_length=64, precision="fp32")
    planned = {s: memory(spec, job, stage, s, 4, 4, 1, False, False).step for s in ("ddp", "zero1", "zero3")}
    assert planned["ddp"] == planned["zero1"] == 0  # fused: plain tensors
    assert planned["zero3"] == foreach_adamw_copy(job, stage.params(spec) // 4)
    tp = memory(spec, job, StageShape(2, True, True, 1, 2), "ddp", 2, 1, 1, False, False)
    assert tp.step == foreach_adamw_copy(job, StageShape(2, True, True, 1, 2).params(spec))


HEAP_THEN_STEP = """
import torch
from meshlm import host_memory
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
assert host_memory.return_freed_buffers() and host_memory.keep_step_buffers(True)
before = rss()
acts, kept = [], []
for _ in range(128):  # forward-backward: 64 MiB of 512 KiB activation rows, between buffers that outlive the step
    acts.append(torch.ones(2**17))
    kept.append(torch.ones(256))  # (a small parameter's gradient or state, a logged value)
del acts
copy = [torch.ones(2**22) for _ in range(4)]  # the optimizer step: 64 MiB of weight-sized (16 MiB) temporaries
print(rss() - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_cpu_ranks_keep_the_activations_beside_the_optimizer_step(monkeypatch):
    """On CPU ranks glibc's heap keeps a step's small activation buffers after they are freed (host_memory.py's
    steady threshold); small buffers that outlive the step sit between them, so the step's weight-sized
    temporaries find no free run large enough and are mapped afresh: measured in a fresh process, the RSS is
    their sum (128 MiB), not their maximum (64 MiB) as on a GPU's caching allocator (without the buffers kept
    between them the freed run is reused: 97 MiB). `--device cpu` plans the
    step's peak so (plan/memory.py heap_retained); long sequences, whose activation rows are mapped buffers of
    their own, and GPUs keep the maximum."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    out = subprocess.run([sys.executable, "-c", HEAP_THEN_STEP], capture_output=True, text=True, check=True).stdout
    assert int(out) > 120 * 2**20
    spec = load_model("tiny")
    stage = StageShape(spec.layers, True, True, 1, 1)
    gpu, cpu, long_cpu = (
        memory(spec, Job(seq_length=s, precision="fp32", cpu_ranks=c), stage, "zero3", 4, 4, 1, False, False)
        for s, c in ((128, False), (128, True), (2**16, True))
    )
    states = sum(cpu.states.values())
    assert gpu.retained == long_cpu.retained == 0
    assert cpu.retained == cpu.act.peak > 0
    backward = states - cpu.unmade + sum(cpu.temp.values()) + cpu.act.peak  # gradients as made (unmade_gradients)
    assert cpu.gpu_total == max(backward, states + cpu.step + cpu.act.peak)


def test_lora_start_up_allocates_the_stored_base():
    """Under LoRA a rank allocates its frozen base as stored (bf16, or NF4 projections beside a bf16 rest) and its
    fp32 adapters before the first step, not fp32 parameters (`plan --simulate` measures the bf16 case equal):
    so llama-70b with an NF4 base fits two 24 GiB GPUs (zero3, full recompute, 1024 tokens), QLoRA's claim, and
    with a bf16 base it cannot start there, which the recommendation says."""
    spec = load_model("llama-70b")
    stage = StageShape(spec.layers, first=True, last=True, in_flight=1, tp=1)
    psi = stage.params(spec)
    assert startup_part(spec, Job(), stage, 2) == psi * 4 // 2
    bf16, nf4 = Job(lora_r=16), Job(lora_r=16, lora_quantize="nf4")
    adapters = memory(spec, bf16, stage, "zero3", 2, 2, 1, True, False).states["adapters"]
    assert startup_part(spec, bf16, stage, 2) == psi * 2 // 2 + adapters
    staging = 8192 * 28672 * 4 // 2  # the largest projection's rows, read in fp32 before quantising
    frozen = memory(spec, nf4, stage, "zero3", 2, 2, 1, True, False).states["frozen parameters"]
    assert startup_part(spec, nf4, stage, 2) == frozen + adapters + staging < 0.3 * psi * 2 // 2
    two = ("--model-name", "llama-70b", "--gpus-per-node", "2", "--gpu-memory", "24GiB", "--lora.r", "16")
    fits = _plan(*two, "--lora.quantize", "nf4", "--seq-length", "1024", "--micro-batch-size", "1")
    assert fits.ranked and fits.ranked[0].candidate.name == "zero3 +ac"
    assert fits.ranked[0].startup < fits.ranked[0].budget
    refused = _plan(*two, "--seq-length", "1024", "--micro-batch-size", "1")
    assert not refused.ranked
    assert (
        refused.reasons[0].startswith("nothing fits: the leanest layout") and "per GPU to start" in refused.reasons[0]
    )
    assert "-" not in refused.reasons[0].split("GiB more than")[0].split(", ")[-1]  # a positive excess
