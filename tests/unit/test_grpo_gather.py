"""objectives/grpo_gather.py on a 1-rank gloo group: inside `gathered` every FSDP unit holds its whole parameters
and a forward frees none of them; after it every unit is sharded again and reshards after forward as the engine
set it (zero3) or keeps its parameters (zero2); the forward's output is bitwise the per-unit one."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from helpers.one_rank import one_rank_group
from meshlm.objectives.grpo_gather import gathered, units
from meshlm.parallel.fsdp import apply_fsdp


@pytest.fixture(scope="module")
def mesh():
    with one_rank_group():
        yield init_device_mesh("cpu", (1,))


def _model(mesh, reshard_after_forward: bool):
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**small, num_key_value_heads=1, tie_word_embeddings=False))
    return apply_fsdp(model, mesh, reshard_after_forward=reshard_after_forward)


def _sharded(model) -> bool:
    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    assert len(kinds) == 1, "some units gathered, some not"
    return kinds.pop()


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_gathered_for_the_block_then_as_the_engine_set(mesh, reshard_after_forward):
    model = _model(mesh, reshard_after_forward)
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        want = model(ids).logits
        model.reshard()
        for m in units(model):
            m.reshard()
        assert len(units(model)) == 5 and _sharded(model)  # two blocks, embedding, head, root
        with gathered(model, reshard_after_forward):
            assert not _sharded(model)
            got = model(ids).logits
            assert not _sharded(model)  # the forward freed nothing
        assert _sharded(model)  # resharded before anything trains
        assert torch.equal(got, want)
        model(ids)
        assert _sharded(model) == reshard_after_forward  # zero3 frees after forward again, zero2 keeps
