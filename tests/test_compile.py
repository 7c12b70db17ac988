"""`--compile`: every transformer block compiled in place (parallel/compiling.py), the same numbers as eager.

Inductor fuses and reorders float32 arithmetic, so results agree to rounding, not to the bit:
observed relative differences are ~1e-6; the tests allow 1e-4. The end-to-end run is test_sharded's
zero3-2 layout (2 ranks, accumulation, activation checkpointing and --compile) against one eager process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig

from meshlm.models.families import transformer_blocks
from meshlm.parallel.compiling import apply_compile

pytestmark = pytest.mark.slow  # in this process, but compiling takes minutes on a CPU

RTOL = 1e-4


def test_blocks_compile_in_place_and_match_eager():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    eager = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    compiled = copy.deepcopy(eager)
    graphs_before = counters["stats"]["unique_graphs"]

    assert apply_compile(compiled) == 2
    blocks = transformer_blocks(compiled)
    # in place: same class and names (checkpoints, TP plans and FSDP units see the same modules)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]

    ids = torch.randint(0, 96, (2, 16))
    for m in (eager, compiled):
        m(input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] > graphs_before  # Dynamo really traced the blocks
    torch.testing.assert_close(
        compiled(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss, rtol=RTOL, atol=0
    )
    for (name, a), (_, b) in zip(compiled.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=1e-6, msg=name)
