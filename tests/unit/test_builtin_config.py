"""The built-in model's config names the tokenizer's end of text: `meshlm generate --model-name EXPORT` stops where
the trained model ends its answer, as generating from the checkpoint does (the export's generation config is what
generate reads there, and Llama's own default, 2, is a byte)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, GenerationConfig

from meshlm.config import ArchConfig, Config
from meshlm.data.builtin import byte_tokenizer
from meshlm.infer.load import eos_ids
from meshlm.models.build import model_config


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_export_generation_stops_at_the_tokenizers_eos(family, tmp_path):
    tokenizer = byte_tokenizer()
    arch = ArchConfig(family=family, hidden_size=32, layers=1, heads=2, kv_heads=2, intermediate_size=64)
    AutoModelForCausalLM.from_config(model_config(Config(arch=arch), len(tokenizer))).save_pretrained(tmp_path)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == tokenizer.eos_token_id
    assert eos_ids(exported, tokenizer, from_checkpoint=False) == [tokenizer.eos_token_id]
