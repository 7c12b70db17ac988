"""NF4 quantisation (parallel/nf4.py): torchao's format bit for bit, slice by slice equal to the whole weight's,
close to the QLoRA paper's definition (and to bitsandbytes' where it is installed) within what the double
quantisation explains, and its refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from meshlm import cli, compat
from meshlm.errors import MeshlmError
from meshlm.parallel import nf4

pytest.importorskip("torchao")


DATA = Path(__file__).parents[1] / "data"


def _weight(rows=512, cols=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02


def _whole_mean(values: torch.Tensor) -> torch.Tensor:
    parts = nf4.mean_parts(values)
    return (parts[0] / parts[1]).float()


def _payload(t) -> list[torch.Tensor]:
    return [getattr(t, name) for name in (*nf4.PAYLOAD, "scaler_mean")]


def _unpacked(packed: torch.Tensor, shape) -> torch.Tensor:
    """4-bit codes packed two a byte, high nibble first (torchao's and bitsandbytes' layout), one per value."""
    packed = packed.flatten()
    return torch.stack([(packed >> 4).long(), (packed & 15).long()], -1).flatten().view(shape)


def _codes_of(t) -> torch.Tensor:
    """The 4-bit code index of every value, in order."""
    return _unpacked(t.quantized_data, t.shape)


def test_same_bits_as_torchaos_to_nf4_given_its_mean():
    w = _weight()
    theirs = compat.nf4_module().to_nf4(w)
    ours = nf4.quantize(w, theirs.scaler_mean)
    for a, b in zip(_payload(ours), _payload(theirs)):
        assert torch.equal(a, b)
    assert torch.equal(ours.get_original_weight(), theirs.get_original_weight())
    # the float64 mean is torchao's fp32 one up to its last bits
    torch.testing.assert_close(_whole_mean(w), theirs.scaler_mean, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_row_slices_quantise_into_the_slices_of_the_whole(ranks):
    """Each rank's rows, quantised with the whole weight's mean (its sums added up in another order), are the
    whole quantisation's dim-0 chunks: what FSDP2 all-gathers back into the one-process weight. With the slice's
    own mean they are not (the broken copy the 2-rank tests catch)."""
    w = _weight()
    whole = nf4.quantize(w, _whole_mean(w))
    slices = list(w.chunk(ranks))
    parts = sum(nf4.mean_parts(s) for s in reversed(slices))
    mean = (parts[0] / parts[1]).float()
    assert torch.equal(mean, _whole_mean(w))
    for got, want in zip((nf4.quantize(s, mean) for s in slices), torch.chunk(whole, ranks)):
        for a, b in zip(_payload(got), _payload(want)):
            assert torch.equal(a, b)
    own = nf4.quantize(slices[0], _whole_mean(slices[0]))
    assert not torch.equal(own.get_original_weight(), torch.chunk(whole, ranks)[0].get_original_weight())


def _paper_codes() -> torch.Tensor:
    """The QLoRA paper's 16 NF4 values (its appendix, as bitsandbytes' create_normal_map builds them): quantiles of
    N(0, 1) for 8 positive and 7 negative levels with an exact zero, scaled to [-1, 1]."""
    normal, offset = torch.distributions.Normal(0.0, 1.0), 0.9677083
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (values / values.abs().max()).float()


def test_close_to_the_papers_definition_within_the_double_quantisation():
    """The paper's NF4 with exact absmax scales against torchao's. Codes: torchao tables the 16 values to 4 decimals
    (5e-5 off the paper's), which moves a decision midpoint by as much: the same code for every value farther than
    1e-4 of one. Values: torchao stores each block's absmax double-quantised (minus the mean, linear int8 per 256
    blocks, steps of max|absmax - mean| / 128 of its 256 blocks: off by half a step, or by a whole one where the
    largest rounds to 128 and is clamped to 127), so a value is off by at most |code| times a step, plus the
    tabling's 5e-5 of the absmax."""
    w = _weight()
    ours = nf4.quantize(w, _whole_mean(w))
    paper = _paper_codes()
    torch.testing.assert_close(ours.nf4, paper, rtol=0, atol=5.1e-5)  # 4 decimals, in fp32
    absmax = nf4.block_absmax(w)
    x = w.reshape(-1, nf4.BLOCK) / absmax[:, None]
    codes = (x.unsqueeze(-1) - paper).abs().argmin(-1).view(w.shape)
    midpoints = (paper[1:] + paper[:-1]) / 2
    far = (x.unsqueeze(-1) - midpoints).abs().amin(-1).view(w.shape) > 1e-4
    assert far.float().mean() > 0.99 and torch.equal(_codes_of(ours)[far], codes[far])
    centred = (absmax - _whole_mean(w)).view(-1, nf4.SCALER_BLOCK)
    step = centred.abs().amax(1, keepdim=True).expand_as(centred).flatten() / 128
    bound = (paper[codes].abs().view(-1, nf4.BLOCK) * (step[:, None] * 1.001) + 5.1e-5 * absmax[:, None]).view(w.shape)
    error = (ours.get_original_weight() - paper[codes] * absmax.repeat_interleave(nf4.BLOCK).view(w.shape)).abs()
    assert (error[far] <= bound[far]).all(), (error - bound)[far].max()


def _bitsandbytes_nf4(w: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """bitsandbytes' NF4 of `w` as (source, codes, dequantised values): as recorded by
    tests/data/make_bitsandbytes_nf4.py for _weight() (so the comparison runs without bitsandbytes), and live
    where bitsandbytes is installed."""
    from safetensors.torch import load_file

    rec = load_file(DATA / "bitsandbytes_nf4.safetensors")
    codes = _unpacked(rec["packed"], w.shape)
    values = (rec["table"][codes].view(-1, nf4.BLOCK) * rec["absmax"][:, None]).view(w.shape)
    out = [("recorded", codes, values)]
    try:
        from bitsandbytes import functional
    except ImportError:
        return out
    packed, state = functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    return [*out, ("installed", _unpacked(packed, w.shape), functional.dequantize_4bit(packed, state))]


def test_close_to_bitsandbytes_nf4():
    """bitsandbytes' CPU NF4 (blocks of 64, compressed statistics) on the same weight. Codes: the same except within
    1e-4 of a decision midpoint (torchao's 4-decimal table). Values: within 1% of the block's absmax: bitsandbytes
    double-quantises the absmaxes in its 8-bit dynamic format (0.75% off at most on this weight), torchao in linear
    int8 (0.41%). Measured with bitsandbytes 0.50.2: 14 of 131072 codes differ, all within 2.1e-5 of a midpoint;
    the others' values within 0.93% of the absmax."""
    w = _weight()
    ours = nf4.quantize(w, _whole_mean(w))
    absmax = nf4.block_absmax(w).repeat_interleave(nf4.BLOCK).view(w.shape)
    for source, their_codes, theirs in _bitsandbytes_nf4(w):
        same = _codes_of(ours) == their_codes
        assert same.float().mean() > 0.999, source
        assert ((ours.get_original_weight() - theirs).abs()[same] <= 0.01 * absmax[same]).all(), source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantised_as_torchao_and_linear_through_it(dtype):
    """The lean dequantisation (small chunks here, to cross their edges) gives torchao's values; an NF4Linear's forward
    and input gradient are those of nn.Linear on them, and its weight gets no gradient."""
    w = _weight()
    q = nf4.quantize(w, _whole_mean(w))
    want = q.get_original_weight().to(dtype)
    assert torch.equal(nf4.dequantize(q, dtype, chunk=96 * 32), want)
    layer = nf4.NF4Linear(256, 512, bias=False)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    x = torch.randn(3, 256, dtype=dtype, requires_grad=True)
    layer(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, want).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_bytes_per_value():
    """4 bits a value, 8 bits of scale per 64, 32 bits of factor per 16384: 4.127 bits a parameter."""
    w = _weight()
    q = nf4.quantize(w, _whole_mean(w))
    payload = sum(t.numel() * t.element_size() for t in (getattr(q, n) for n in nf4.PAYLOAD))
    assert payload * 8 / w.numel() == pytest.approx(4 + 8 / 64 + 32 / 16384)


SHAPES = [
    *("--arch.hidden-size", "256", "--arch.layers", "1", "--arch.heads", "4", "--arch.kv-heads", "4"),
    *("--arch.intermediate-size", "512", "--lora.r", "4", "--lora.quantize", "nf4"),
]


def _refusal(args, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *args, "--output-dir", str(out)])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("meshlm: error: "), lines
    assert not out.exists()
    return lines[0]


def test_without_torchao_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, compat.NF4_MODULE, None)  # import of it fails, as without torchao
    assert "pip install 'meshlm[qlora]'" in _refusal(SHAPES, tmp_path, capsys)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nproc", "2", "--parallel.tp", "2"], "single, ddp, zero3, fsdp or hsdp (zero2 with fp32 compute)"),
        (["--nproc", "2", "--parallel.cp", "2"], "each also under --parallel.pp, without tensor, context or expert"),
        (["--nproc", "2", "--strategy", "zero2", "--mixed-precision", "bf16"], "not --strategy zero2 with"),
        (["--nproc", "8", "--strategy", "zero3"], "split by rows over 8 ranks"),
        (["--arch.hidden-size", "64", "--arch.intermediate-size", "128"], "4096 values: not a multiple of 16384"),
        (["--float8", "tensorwise"], "both requantise the projections: drop one"),  # rowwise: torch 2.13 on CPU
        (["--arch.family", "gpt2"], "model family 'gpt2' has none (its projections are Conv1D)"),
    ],
)
def test_layouts_and_shapes_that_cannot_hold_nf4(args, words, tmp_path, capsys):
    assert words in _refusal([*SHAPES, *args], tmp_path, capsys)


def test_quantized_layers_are_the_block_projections():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=64))
    names = [n for n, _ in nf4.quantized_layers(model)]
    assert len(names) == 14 and all(".layers." in n for n in names) and "lm_head" not in names


def test_layout_refusal_names_no_working_layout_as_broken():
    """Every layout the refusal names as working is one check() lets through (a 2-rank world)."""
    from meshlm import layout
    from meshlm.config import Config

    strategies = ("single", "ddp", "zero3", "fsdp", "hsdp", "zero2")
    for strategy, pp in [(s, pp) for s in strategies for pp in (1, 2) if s != "single" or pp == 1]:
        cfg = Config()
        cfg.lora.r, cfg.lora.quantize, cfg.strategy, cfg.parallel.pp = 4, "nf4", strategy, pp
        ranks = pp * (1 if strategy == "single" else 2)  # under pp: 2 data-parallel ranks a stage
        try:
            assert nf4.layout_problem(layout.resolve(cfg, ranks, _config())) == ""
        except MeshlmError as e:  # pragma: no cover - the message says which
            pytest.fail(str(e))


def test_expert_parallel_refused_in_one_line():
    """Expert parallel splits an expert's weights other than by whole dim-0 groups of each projection: refused,
    naming the layouts that hold NF4 (tensor parallel: test_layouts_and_shapes_that_cannot_hold_nf4)."""
    from transformers import Qwen3MoeConfig

    from meshlm import layout
    from meshlm.config import Config

    cfg = Config()
    cfg.lora.r, cfg.lora.quantize, cfg.strategy, cfg.parallel.ep = 4, "nf4", "zero3", 2
    moe = Qwen3MoeConfig(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=1, num_attention_heads=4
    )
    with pytest.raises(MeshlmError) as e:
        layout.resolve(cfg, 4, moe)
    assert "\n" not in str(e.value) and str(e.value).endswith("not --parallel.ep 2"), e.value
    assert "single, ddp, zero3, fsdp or hsdp" in str(e.value), e.value


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("pipelined", [False, True])
def test_planner_gathers_nf4_projections_under_fsdp(pipelined):
    """FSDP gathers the projections as NF4 (4.13 bits, not the compute dtype's 16): one unit and the prefetched one,
    or under a pipeline the stage's whole blocks, kept gathered for the step."""
    from meshlm.plan.job import Job
    from meshlm.plan.lora_memory import NF4_BYTES, nf4_dequantised, nf4_projections
    from meshlm.plan.memory import memory
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    spec, stage = load_model("llama-70b"), StageShape(layers=40, first=True, last=False, in_flight=2, tp=1)
    temps = [
        memory(spec, Job(lora_r=16, lora_quantize=q), stage, "zero3", 4, 4, 1, True, False, pipelined).temp
        for q in ("none", "nf4")
    ]
    blocks = 40 if pipelined else 2
    saved = blocks * nf4_projections(spec)[0] * (2 - NF4_BYTES)
    extra = nf4_dequantised(spec, 2)  # the one projection dequantised for its matmul
    assert sum(temps[0].values()) - sum(temps[1].values()) == pytest.approx(saved - extra, abs=blocks)
