"""apply_fsdp's input embedding unit on a 1-rank mesh: a plain lookup table keeps its weight sharded through
backward (no vocabulary-sized all-gather there); an embedding that holds more parameters (Inkling's normed
embedding, an RMSNorm inside) is gathered for backward as any unit. Before: its norm's weight was read from a
freed buffer in backward and every rank died with SIGSEGV under zero3 (the coverage table's inkling rows)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from helpers.one_rank import one_rank_group
from meshlm import compat_transformers
from meshlm.parallel.fsdp import apply_fsdp, backward_reads_no_parameter

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    pad_token_id=256,
    bos_token_id=None,
    eos_token_id=None,
)
EXPERTS = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with one_rank_group():
        yield init_device_mesh("cpu", (1,))


def test_only_a_plain_lookup_table_stays_sharded_in_backward():
    llama = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**TINY))
    gemma = tf.AutoModelForCausalLM.from_config(tf.Gemma3TextConfig(**TINY))  # scaled: a buffer, no parameter
    inkling = tf.AutoModelForCausalLM.from_config(tf.InklingTextConfig(**TINY, **EXPERTS))
    assert backward_reads_no_parameter(llama.get_input_embeddings())
    assert backward_reads_no_parameter(gemma.get_input_embeddings())
    # before 5.23 Inkling norms its embeddings in a module of its own: its table is a plain one there
    normed = not compat_transformers.embedding_norms("inkling_text")
    assert backward_reads_no_parameter(inkling.get_input_embeddings()) is not normed


def test_zero3_units_of_a_normed_embedding_give_the_unsharded_gradients(mesh):
    torch.manual_seed(0)
    config = tf.InklingTextConfig(**TINY, **EXPERTS, swa_head_dim=16)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    sharded = apply_fsdp(copy.deepcopy(model), mesh)
    ids = torch.randint(0, 250, (2, 16))
    want, got = model(input_ids=ids, labels=ids), sharded(input_ids=ids, labels=ids)
    want.loss.backward()
    got.loss.backward()  # the broken unit crashed the process here
    for (name, p), q in zip(model.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-7, msg=name)
