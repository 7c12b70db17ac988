"""Activation offload in one process: the saved activations go out and come back unchanged, alone and under
activation checkpointing (then only each block's input goes out). On CPU the "device" is the CPU itself, so
this checks the bookkeeping (which tensors, in which order, fetched ahead); the overlap is a GPU matter."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import LlamaConfig, LlamaForCausalLM

from meshlm.parallel.offload import ActivationOffload

HIDDEN, SEQ, BATCH = 128, 256, 2
MIN_BYTES = 1 << 16  # below one block input (256 KiB here)


def _step(model, ctx):
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (BATCH, SEQ))
    model.zero_grad()
    with ctx:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()
    }


def test_offloaded_activations_come_back_unchanged():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
    )
    model = LlamaForCausalLM(cfg)
    loss, grads = _step(model, contextlib.nullcontext())

    offload = ActivationOffload(torch.device("cpu"), MIN_BYTES)
    got, got_grads = _step(model, offload)
    assert got == loss and all(torch.equal(got_grads[n], g) for n, g in grads.items())
    every = offload.offloaded_bytes
    block_input = BATCH * SEQ * HIDDEN * 4
    assert every > 3 * 10 * block_input  # every block saves many hidden-sized tensors

    checkpointed = copy.deepcopy(model)
    layers = checkpointed.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    offload = ActivationOffload(torch.device("cpu"), MIN_BYTES)
    got, got_grads = _step(checkpointed, offload)
    assert got == loss and all(torch.equal(got_grads[n], g) for n, g in grads.items())
    # each checkpointed block's input went out, none of its insides (recomputed in backward instead)
    assert 3 * block_input <= offload.offloaded_bytes < every / 3
