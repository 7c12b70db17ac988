"""Model parallel in this process: the layout checks of tp/pp/layer-split, the stage split (balanced and by
hand) chained against the whole model, and the TP checks. The multi-rank runs are tests/test_model_parallel.py."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BeamConfig,
    DeepseekV32Config,
    GPT2Config,
    GptOssConfig,
    InklingTextConfig,
    Llama4TextConfig,
    LlamaConfig,
    MiniMaxConfig,
    MistralConfig,
    Qwen2Config,
)

from meshlm.errors import MeshlmError
from meshlm.models.families import tp_plan
from meshlm.models.stages import build_stages, stage_layers
from meshlm.parallel.tensor import check_tp


@pytest.mark.parametrize(
    "world, keys, message",
    [
        (2, {"parallel.pp": 2, "parallel.micro_batches": 3}, "does not split into --parallel.micro-batches 3 equal"),
        (2, {"parallel.tp": 2, "arch.kv_heads": 1}, "--parallel.tp 2 does not divide the model's 1 key/value heads"),
        (4, {"parallel.tp": 2, "strategy": "ddp"}, "needs --strategy fsdp (DDP cannot hold tensor-parallel shards)"),
        (4, {"parallel.pp": 2, "strategy": "zero1"}, "pipeline parallel composes with --strategy ddp"),
        (
            2,
            {"parallel.pp": 2, "parallel.pp_split": "0"},
            "--parallel.pp-split needs 1 layer index between 1 and 3 (the first",
        ),
        (
            2,
            {"parallel.pp": 2, "parallel.schedule": "interleaved-1f1b", "parallel.virtual_stages": 4},
            "8 pipeline stages need at least 8 layers; the model has 4",
        ),
        (1, {"parallel.sequence_parallel": True}, "--parallel.sequence-parallel needs --parallel.tp 2 or more"),
        (
            2,
            {"parallel.tp": 2, "parallel.sequence_parallel": True, "seq_length": 63},
            "--seq-length 63 is not a multiple",
        ),
        (1, {"strategy": "layer-split", "devices": "cpu"}, "needs at least two --devices"),
        (1, {"strategy": "layer-split", "devices": "cpu,cpu", "parallel.tp": 2}, "does not combine with --parallel.tp"),
        (
            1,
            {"strategy": "layer-split", "devices": ",".join(["cpu"] * 5)},
            "lists 5 devices but the model has 4 layers",
        ),
    ],
)
def test_layout_checks_name_the_fix(world, keys, message):
    from meshlm.config import load
    from meshlm.layout import resolve

    cfg = load(None, [("arch.layers", "4"), *((k, str(v)) for k, v in keys.items())])
    with pytest.raises(MeshlmError, match=re.escape(message)):
        resolve(cfg, world)


# ----------------------------------------------------------------- in one process: the split itself

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}
CONFIGS = {
    "llama": LlamaConfig(**SMALL),
    "qwen2": Qwen2Config(**SMALL),
    "mistral": MistralConfig(**SMALL, sliding_window=8),  # shorter than the sequence: sliding masks
    "gpt2": GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=64),
}


@pytest.mark.parametrize("family", CONFIGS)
def test_stages_chained_compute_the_model(family):
    """The stages of every split, run one after the other, give the model's own logits exactly, and
    with a KV cache (generation) too."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family], attn_implementation="sdpa").eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for n in (1, 2, 3, 4):
            h = ids
            for stage in build_stages(model, n):
                h = stage(h)
            assert torch.equal(h, want), (family, n)
        from transformers import DynamicCache

        cache, stages = DynamicCache(config=model.config), build_stages(model, 2)
        h = ids[:, :10]
        for stage in stages:
            h = stage(h, past_key_values=cache)
        h = ids[:, 10:]
        for stage in stages:
            h = stage(h, past_key_values=cache)
        torch.testing.assert_close(h, want[:, 10:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**SMALL),  # its forward masks packed documents apart (position_ids reach create_causal_mask)
        GptOssConfig(**SMALL, head_dim=16, num_local_experts=4, sliding_window=8),  # its forward does not
    ],
    ids=lambda c: c.model_type,
)
def test_stages_mask_packed_documents_as_the_model_does(config):
    """Packed documents restart their positions. A stage makes its masks from them only where the model's own
    forward does: GPT-OSS's attends across documents, and a stage that masked them apart differed under pp 2
    (first loss 7.2597 against one process's 7.2333 on the coverage table's tiny model)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, -1)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        h = ids
        for stage in build_stages(model, 2):
            h = stage(h, position_ids=positions)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)


LATENT = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32)
MOE = dict(num_experts_per_tok=2, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "config",
    [
        # a linear-attention layer and a softmax one that slides because the config sets a window
        MiniMaxConfig(**MOE, num_key_value_heads=2, head_dim=16, intermediate_size=128, num_local_experts=4,
                      layer_types=["linear_attention", "full_attention"], sliding_window=8),
        # indexed attention: the indexer reads the causal mask itself
        DeepseekV32Config(**MOE, **LATENT, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=64,
                          n_routed_experts=4, n_group=1, topk_group=1),
        # hybrid_sliding layers slide (a window of 8 in 16 tokens); the final hidden states are divided by 24
        InklingTextConfig(**MOE, num_key_value_heads=2, head_dim=16, swa_head_dim=16, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, n_routed_experts=4, moe_intermediate_size=32,
                          layer_types=["hybrid_sliding", "hybrid"], sliding_window_size=8),
        # chunked attention (chunks of 8 in 16 tokens) in every layer
        Llama4TextConfig(**MOE, num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
                         attention_chunk_size=8),
    ],
    ids=lambda c: c.model_type,
)  # fmt: skip
def test_stages_make_each_layer_types_mask_as_the_model_does(config):
    """Each layer type gets the mask the decoder's own forward gives it (families.mask_function). With a causal
    mask for every type, MiniMax's stages differed by 3.6e-3 and DeepSeek-V3.2's indexer failed on None; Inkling's
    by 2.5e-3 (relative, the coverage table's pp 2) with its hybrid_sliding layers unmasked."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        h = ids
        for stage in build_stages(model, 2):
            h = stage(h)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)


def test_stages_give_layers_without_rotary_what_the_model_does():
    """Beam's full-attention layers take no rotary embedding but a query scaling by position, which its forward
    computes (families.attention_scaling): stages give them the same (a KeyError on rank 1 before). Positions from
    4000 make the scaling 1.12, not 1.0008."""
    config = BeamConfig(**MOE, num_key_value_heads=2, head_dim=16, intermediate_size=128, n_routed_experts=4,
                        moe_intermediate_size=64, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, positions = torch.randint(0, 128, (2, 16)), torch.arange(4000, 4016).expand(2, -1)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        h = ids
        for stage in build_stages(model, 2):
            h = stage(h, position_ids=positions)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)


def test_balanced_split_and_manual_split():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**SMALL, "num_hidden_layers": 8, "vocab_size": 4096}))
    # The 4096 x 64 embedding and head weigh about 2.5 blocks each: the end stages get fewer blocks.
    assert stage_layers(model, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(s) for s in stage_layers(model, 4)] == [1, 3, 3, 1]
    assert stage_layers(model, 3, "2,5") == [[0, 1], [2, 3, 4], [5, 6, 7]]
    with pytest.raises(MeshlmError, match="2 increasing layer indices"):
        stage_layers(model, 3, "5,2")


def test_tp_checks_name_what_does_not_divide():
    with pytest.raises(MeshlmError, match="does not divide the model's 4 attention heads"):
        check_tp(LlamaConfig(**SMALL), 8)
    with pytest.raises(MeshlmError, match="does not divide the model's 2 key/value heads"):
        check_tp(LlamaConfig(**SMALL), 4)
    from transformers import BloomConfig

    missing = "tensor parallel needs a TP plan for model family 'bloom': its config has no base_model_tp_plan"
    with pytest.raises(MeshlmError, match=missing):
        tp_plan(BloomConfig())
