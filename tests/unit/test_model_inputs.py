"""A model directory without a usable tokenizer is named as such, with --tokenizer-name as the fix (transformers
builds an empty tokenizer from such a directory, and the data would then be blamed)."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from meshlm.config import Config
from meshlm.errors import MeshlmError
from meshlm.models.build import load_tokenizer


@pytest.fixture
def qwen3_dir(tmp_path):
    dims = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    Qwen3Config(**dims, intermediate_size=64, vocab_size=320).save_pretrained(tmp_path)
    return tmp_path


def test_no_tokenizer_files(qwen3_dir):
    with pytest.raises(MeshlmError, match=f"^model directory {qwen3_dir} has no tokenizer files .* --tokenizer-name"):
        load_tokenizer(Config(model_name=str(qwen3_dir)))


def test_tokenizer_config_without_a_vocabulary(qwen3_dir):
    (qwen3_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    with pytest.raises(MeshlmError, match=r"gives an empty tokenizer \(vocabulary 1\); give one with --tokenizer-name"):
        load_tokenizer(Config(model_name=str(qwen3_dir)))


def test_damaged_tokenizer_json_is_named(qwen3_dir):
    (qwen3_dir / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": {"vocab": {"\xff": 0')
    with pytest.raises(MeshlmError, match=r"tokenizer.json:1 is not UTF-8 text \(byte 0xff\)"):
        load_tokenizer(Config(model_name=str(qwen3_dir)))
