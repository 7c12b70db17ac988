"""The models `meshlm plan --model-name` knows by name: copies of well-known configs, so planning needs no network."""

from __future__ import annotations

# Presets are copies of well-known configs, so planning needs no network; the command runs their hub id, an
# ungated copy of the weights where one exists (meta-llama's own repositories need an access request).
PRESETS = {
    "llama-7b": (
        "NousResearch/Llama-2-7b-hf",
        dict(family="llama", layers=32, hidden=4096, heads=32, kv_heads=32, mlp=11008, vocab=32000, max_positions=4096),
    ),
    "llama-13b": (
        "NousResearch/Llama-2-13b-hf",
        dict(family="llama", layers=40, hidden=5120, heads=40, kv_heads=40, mlp=13824, vocab=32000, max_positions=4096),
    ),
    "llama-70b": (
        "NousResearch/Llama-2-70b-hf",
        dict(family="llama", layers=80, hidden=8192, heads=64, kv_heads=8, mlp=28672, vocab=32000, max_positions=4096),
    ),
    "llama-405b": (  # Llama 3.1 405B's dimensions (its RoPE scaling does not change the memory)
        "meta-llama/Llama-3.1-405B",
        dict(
            family="llama",
            layers=126,
            hidden=16384,
            heads=128,
            kv_heads=8,
            mlp=53248,
            vocab=128256,
            max_positions=131072,
        ),
    ),
    "gpt2": (
        "openai-community/gpt2",
        dict(family="gpt2", layers=12, hidden=768, heads=12, kv_heads=12, mlp=3072, vocab=50257, max_positions=1024),
    ),
}
TINY = "tiny"  # meshlm's built-in model (`meshlm train` without --model-name)


def _qwen3_235b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(  # Qwen/Qwen3-235B-A22B's config.json
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_cache=False,
    )


def _deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(  # deepseek-ai/DeepSeek-V3's dimensions (MLA attention; no TP plan for it in meshlm)
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        use_cache=False,
    )


# Mixtures of experts, as their transformers configs (their dimensions alone do not say the model).
MOE_PRESETS = {
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", _qwen3_235b),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", _deepseek_v3),
}
