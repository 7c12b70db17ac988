"""The training blocks alone, for tests that need no held-out part."""

from __future__ import annotations

from meshlm.config import Config
from meshlm.data.load import load_data
from meshlm.data.pack import Blocks


def load_blocks(cfg: Config, tokenizer, tokenizer_id: str) -> Blocks:
    """The training blocks of `cfg`'s dataset, packed into (or read from) the cache."""
    return load_data(cfg, tokenizer, tokenizer_id)[0]
