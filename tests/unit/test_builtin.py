"""The embedded default. Its model's config names the tokenizer's end of text: `meshlm generate --model-name EXPORT`
stops where the trained model ends its answer, as generating from the checkpoint does (the export's generation
config is what generate reads there, and Llama's own default, 2, is a byte). Its corpus's records are right, and
blocks cached from an older corpus are never trained on."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, GenerationConfig

from meshlm.config import BUILTIN_TASKS, ArchConfig, Config
from meshlm.data import builtin, load
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


def test_majority_records_are_right_and_every_task_is_drawn():
    records = builtin.corpus(300, seed=3)
    majority = [r for r in records if builtin.task_of(r) == "majority"]
    assert majority and all(r["input"].count(r["output"]) > len(r["input"]) / 2 for r in majority)
    assert {r["output"] for r in majority} == {"a", "b"}
    assert {builtin.task_of(r) for r in records} == set(BUILTIN_TASKS)


def test_cached_builtin_blocks_follow_the_corpus_version(monkeypatch):
    cfg = Config()
    before = load.cache_key(cfg, builtin.TOKENIZER_ID, builtin.VOCAB)
    monkeypatch.setattr(builtin, "CORPUS_VERSION", builtin.CORPUS_VERSION + 1)
    assert load.cache_key(cfg, builtin.TOKENIZER_ID, builtin.VOCAB) != before
