"""LoRA in one process: which parameters train, the frozen base, and the checks on --lora.* values."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import Config, LoraConfig
from meshlm.data.builtin import byte_tokenizer
from meshlm.errors import MeshlmError
from meshlm.models.build import build_model
from meshlm.parallel import lora


def tiny(**lora_kw) -> tuple[Config, torch.nn.Module]:
    cfg = Config(lora=LoraConfig(r=4, **lora_kw))
    cfg.arch.hidden_size, cfg.arch.layers, cfg.arch.intermediate_size = 64, 2, 128
    torch.manual_seed(0)
    return cfg, build_model(cfg, byte_tokenizer())


def test_only_adapters_train_and_the_base_stays_bitwise_equal():
    cfg, model = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora.apply_lora(model, cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 250, (2, 16))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for k, v in base.items():  # peft moved each wrapped weight under .base_layer
        key = k if k in after else k.replace(".weight", ".base_layer.weight")
        assert torch.equal(after[key], v), k
    assert any(after[n].abs().sum() > 0 for n in after if ".lora_B." in n)  # B started at zero and trained


def test_adapter_init_depends_on_the_seed_only():
    (cfg, a), (_, b) = tiny(), tiny()
    torch.rand(3)  # a different global RNG state before injecting must not matter
    lora.apply_lora(a, cfg), lora.apply_lora(b, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_saved_part_keeps_adapters_only():
    cfg, model = tiny()
    sd = lora.apply_lora(model, cfg).state_dict()
    assert set(lora.saved_part(sd)) == {k for k in sd if ".lora_" in k}
    assert lora.saved_part({"w": 1}) == {"w": 1}  # full fine-tuning: everything


@pytest.mark.parametrize(
    "kw, words", [({"targets": "qproj"}, ["qproj", "q_proj", "lm_head"]), ({"r": 33}, ["33", "32"])]
)
def test_bad_targets_and_rank(kw, words):
    cfg, model = tiny()
    cfg.lora.targets = kw.get("targets", "")
    cfg.lora.r = kw.get("r", 4)
    with pytest.raises(MeshlmError) as e:
        lora.apply_lora(model, cfg)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


def test_dp_strategy_is_refused():
    with pytest.raises(MeshlmError, match="ddp"):
        lora.check_strategy(Config(lora=LoraConfig(r=8)), "dp")
    lora.check_strategy(Config(), "dp")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_planner_counts_the_adapters_peft_builds(family):
    from meshlm.models.build import model_config
    from meshlm.plan.lora_memory import lora_params
    from meshlm.plan.spec import from_hf_config

    cfg, _ = tiny()
    cfg.arch.family, cfg.lora.r = family, 8
    model = lora.apply_lora(build_model(cfg, byte_tokenizer()), cfg)
    built = sum(p.numel() for p in model.parameters() if p.requires_grad)
    spec = from_hf_config(family, model_config(cfg, len(byte_tokenizer())))
    assert lora_params(spec, 8) * cfg.arch.layers == built


@pytest.mark.parametrize("pipelined", [False, True])
def test_planner_counts_fsdp_gradients_of_the_adapters_only(pipelined):
    """Under LoRA FSDP's unsharded gradients are the adapters' (the base is frozen): one block's in bf16 plus their
    fp32 copy for the reduce-scatter, or under a pipeline the stage's, fp32, accumulated over the micro-batches;
    counting the base's would price a LoRA job under FSDP as if it trained the base."""
    from meshlm.plan.job import Job
    from meshlm.plan.lora_memory import lora_params
    from meshlm.plan.memory import memory
    from meshlm.plan.shape import StageShape
    from meshlm.plan.spec import load_model

    spec, stage = load_model("llama-70b"), StageShape(layers=40, first=True, last=False, in_flight=2, tp=1)
    job = Job(lora_r=16, precision="bf16")
    mem = memory(spec, job, stage, "zero3", 32, 32, 1, True, False, pipelined)
    adapters = lora_params(spec, 16)  # one block's
    if pipelined:
        assert mem.temp["unsharded stage gradients, accumulated over micro-batches"] == 4 * 40 * adapters
    else:
        assert mem.temp["unsharded unit gradients"] == 2 * adapters
        full = memory(spec, Job(precision="bf16"), stage, "zero3", 32, 32, 1, True, False)
        assert full.act.transient - mem.act.transient == pytest.approx(4 * (stage.gathered_unit(spec) - adapters))


def _filled(cfg: Config, adapters: bool, pretrained: str | None = None) -> dict[str, torch.Tensor]:
    """The base as a layout builds it (meta, adapters injected first when asked, then materialize), by plain names."""
    from meshlm.models.materialize import InitialWeights, materialize

    model = build_model(cfg, byte_tokenizer(), "meta")
    if adapters:
        lora.apply_lora(model, cfg)
    materialize(model, InitialWeights.of(model, cfg.seed, lora.initial_value), "cpu", pretrained)
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if not lora.is_adapter(k)}


def test_a_lora_runs_base_is_the_plain_models(tmp_path):
    """Training injects the adapters before materializing; export and generate rebuild the base without them.
    Both must give the same base: seeded init by the plain names, --pretrained read under the plain names
    (peft's `.base_layer` once made `train --lora.r --pretrained` fail: no such tensor in the safetensors)."""
    cfg, model = tiny()
    plain, wrapped = _filled(cfg, False), _filled(cfg, True)
    assert set(plain) == set(wrapped) and all(torch.equal(plain[k], wrapped[k]) for k in plain)
    model.save_pretrained(tmp_path)
    read = _filled(cfg, True, str(tmp_path))
    saved = model.state_dict()
    assert all(torch.equal(read[k], saved[k]) for k in saved)


def test_a_bf16_base_is_the_fp32_base_rounded_and_the_adapters_stay_fp32():
    """cast_base after the initial weights' twin is taken (parallelize's order): the frozen base is stored in bf16
    and holds the fp32 base's values rounded; adapters and buffers keep their dtype; fp32 mixed precision or
    --lora.base-dtype fp32 leave the base as it is."""
    from meshlm.models.materialize import InitialWeights, materialize

    cfg, _ = tiny()
    want = _filled(cfg, True)

    def filled(cfg):
        model = lora.apply_lora(build_model(cfg, byte_tokenizer(), "meta"), cfg)
        init = InitialWeights.of(model, cfg.seed, lora.initial_value)
        lora.cast_base(model, cfg)
        materialize(model, init, "cpu")
        return model

    cfg.mixed_precision = "bf16"
    model = filled(cfg)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == (torch.float32 if lora.is_adapter(n) else torch.bfloat16) for n, d in dtypes.items()), dtypes
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    got = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if not lora.is_adapter(k)}
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
    cfg.lora.base_dtype = "fp32"
    assert all(p.dtype == torch.float32 for p in filled(cfg).parameters())


@pytest.mark.parametrize(
    "pairs, words",
    [
        ([("lora.r", 4), ("lora.base_dtype", "fp16")], "--lora.base-dtype must be one of auto, fp32, bf16"),
        ([("lora.base_dtype", "bf16"), ("mixed_precision", "bf16")], "--lora.base-dtype bf16 is read only with"),
        ([("lora.r", 4), ("lora.base_dtype", "bf16")], "--mixed-precision bf16"),
    ],
)
def test_bad_base_dtype_is_refused_in_one_line(pairs, words):
    from meshlm import config as config_mod

    with pytest.raises(MeshlmError) as e:
        config_mod.validate(config_mod.load(None, pairs))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_header_names_how_the_frozen_base_is_stored():
    """The run header's LoRA line ends with the frozen base's storage (train/header.py), which its memory follows."""
    from meshlm import config as config_mod
    from meshlm.train.header import frozen_base

    def base(*pairs):
        return frozen_base(config_mod.load(None, [("lora.r", 4), *pairs]))

    assert base() == "fp32"
    assert base(("mixed_precision", "bf16")) == "bf16"
    assert base(("mixed_precision", "bf16"), ("lora.base_dtype", "fp32")) == "fp32"
    nf4 = base(("mixed_precision", "bf16"), ("lora.quantize", "nf4"))
    assert nf4 == "NF4 block projections, the rest bf16 (--lora.quantize nf4)"
