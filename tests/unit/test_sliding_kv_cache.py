"""generate's KV cache keeps a sliding-window layer's window only, and the tokens stay transformers' own."""

from __future__ import annotations

import torch
import transformers as tf

from meshlm.infer.decode import Sampling, generate_batch, kv_cache, make_batch, model_forward

WINDOW, PROMPT, NEW = 8, 30, 6


def test_a_sliding_layer_caches_its_window_and_a_global_layer_everything():
    config = tf.Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids = [(5 * i) % 60 + 2 for i in range(PROMPT)]
    caches = []

    def new_cache():
        caches.append(kv_cache(config))
        return caches[-1]

    batch = make_batch([0], [ids], 0, "cpu")
    (done,), _ = generate_batch(model_forward(model), new_cache, batch, NEW, [], 0, Sampling())
    want = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, PROMPT:].tolist()
    assert done.token_ids == want
    sliding, full = (layer.keys.shape[-2] for layer in caches[0].layers)
    assert full == PROMPT + NEW - 1  # the last token is picked, never fed back
    assert sliding < WINDOW < full
