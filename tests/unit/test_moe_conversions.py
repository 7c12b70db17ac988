"""--pretrained reads through transformers' checkpoint conversion, one slice at a time, and export writes
transformers' own layout back.

Tiny Mixtral, Qwen3-MoE and OLMoE models saved by transformers' save_pretrained hold per-expert tensors
(`block_sparse_moe.experts.N.w1.weight`, `mlp.experts.N.gate_proj.weight`) where the model has grouped
ones (`mlp.experts.gate_up_proj`). Every model tensor read through the conversion equals what
transformers' from_pretrained loads; a slice of experts reads only those experts' stored tensors; and the
model's tensors converted back are the file's, name for name and value for value.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from meshlm.models.conversions import saved_groups, saved_names
from meshlm.models.safetensors_read import SafetensorsCheckpoint

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "mixtral": lambda: MixtralConfig(**SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8
    ),
    "olmoe": lambda: OlmoeConfig(
        **SMALL, intermediate_size=16, num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1
    ),
    "llama": lambda: LlamaConfig(**SMALL, intermediate_size=64),  # nothing to convert: read as stored
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[request.param]()).save_pretrained(d)
    loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    return request.param, d, loaded, skeleton


def _everything(shape) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def test_every_tensor_reads_as_transformers_loads_it(saved):
    kind, d, loaded, skeleton = saved
    ckpt = SafetensorsCheckpoint(d)
    ckpt.follow(skeleton)
    grouped = 0
    for name, want in loaded.state_dict().items():
        if name == "lm_head.weight" and loaded.config.tie_word_embeddings:
            continue
        key = ckpt.key(name)
        assert key is not None, name
        grouped += not isinstance(key, str) and len(key.keys()) > 1
        got = ckpt.read(key, _everything(want.shape))
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0, msg=name)
    assert grouped == (0 if kind == "llama" else 2 * 2)  # gate_up_proj and down_proj of 2 layers


def test_a_slice_of_experts_reads_only_their_tensors(saved):
    kind, d, loaded, skeleton = saved
    if kind == "llama":
        pytest.skip("no experts")
    ckpt = SafetensorsCheckpoint(d)
    ckpt.follow(skeleton)
    read = []
    plain_read = ckpt.read

    def counting(key, index):
        if isinstance(key, str):
            read.append(key)
        return plain_read(key, index)

    ckpt.read = counting
    name = "model.layers.1.mlp.experts.gate_up_proj"
    want = loaded.state_dict()[name]
    width = want.shape[1] // 2
    index = (slice(1, 3), slice(width - 2, width + 3), slice(4, 20))  # experts 1-2, across the gate|up seam
    got = ckpt.read(ckpt.key(name), index)
    torch.testing.assert_close(got, want[index], rtol=0, atol=0)
    assert read and all(any(f".experts.{e}." in k for e in (1, 2)) for k in read), read
    assert len(read) == 2 * 2  # gate and up of experts 1 and 2, nothing else


def test_model_tensors_save_back_as_the_file(saved):
    kind, d, loaded, skeleton = saved
    state = loaded.state_dict()
    names = [n for n in state if not (n == "lm_head.weight" and loaded.config.tie_word_embeddings)]
    written = {}
    for group in saved_groups(skeleton, names):
        written.update(saved_names(skeleton, {n: state[n] for n in group}))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert sorted(written) == sorted(f.keys())
        for k in f.keys():
            torch.testing.assert_close(written[k], f.get_tensor(k), rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("pretrained", [False, True])
def test_lora_on_the_experts_keeps_the_plain_base(saved, pretrained):
    """peft wraps a module once per adapted weight (`experts.base_layer.base_layer.gate_up_proj`): the base is
    still seeded and read under the plain names, so export and generate, which rebuild it without adapters,
    find the trained run's base (a single `.base_layer` stripped once gave gate_up_proj another seed)."""
    from meshlm import config as config_mod
    from meshlm.data.builtin import byte_tokenizer
    from meshlm.models.build import build_model
    from meshlm.models.families import base_name
    from meshlm.models.materialize import InitialWeights, materialize
    from meshlm.parallel import lora

    kind, d, loaded, _ = saved
    if kind == "llama":
        pytest.skip("no experts")
    keys = [("model_name", str(d)), ("lora.r", "2"), ("lora.targets", "gate_up_proj,down_proj")]
    cfg = config_mod.load(None, keys)
    tok = byte_tokenizer()  # 259 ids: more than the models' 96, which build_model keeps

    def base(adapters: bool) -> dict[str, torch.Tensor]:
        model = build_model(cfg, tok, "meta")
        if adapters:
            lora.apply_lora(model, cfg)
        materialize(
            model, InitialWeights.of(model, cfg.seed, lora.initial_value), "cpu", str(d) if pretrained else None
        )
        return {base_name(k): v for k, v in model.state_dict().items() if not lora.is_adapter(k)}

    plain, wrapped = base(False), base(True)
    assert any(".experts.gate_up_proj" in k for k in wrapped) and set(plain) == set(wrapped)
    assert all(torch.equal(plain[k], wrapped[k]) for k in plain)
    if pretrained:
        want = {k: v for k, v in loaded.state_dict().items() if "embed" not in k and "lm_head" not in k}  # resized
        assert not [k for k, v in want.items() if not torch.equal(wrapped[k], v.float())]
