"""--attention: meshlm's kernels (meshlm_varlen per document, meshlm_sdpa one masked call with the key/value heads
shared) equal transformers' dense document mask for SDPA on packed uneven records (losses and gradients, fp32),
make their plan or mask once per forward, and leave generate's padded prefill to SDPA; which kernel each choice
gives on CPU, and the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import FalconConfig, Gemma2Config, LlamaConfig, LlamaForCausalLM, MistralConfig

from meshlm.errors import MeshlmError
from meshlm.models import attention


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def _packed(seed: int, rows: int = 3, seq: int = 96) -> torch.Tensor:
    """Position ids of packed documents of 1 to 60 tokens, the last one cut at the block's end; every third seed
    starts with two rows of one document each (a run of two equal documents: one SDPA call over both rows)."""
    g = torch.Generator().manual_seed(seed)
    out = [list(range(seq))] * (2 if seed % 3 == 0 else 0)
    for _ in range(rows - len(out)):
        pos = []
        while len(pos) < seq:
            pos += range(int(torch.randint(1, 61, (1,), generator=g)))
        out.append(pos[:seq])
    return torch.tensor(out)


def _loss_and_grads(model, kernel: str, ids, positions):
    model.set_attn_implementation(kernel)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize(
    "kernel, made_by, steps", [(attention.DOCUMENTS, "Plan", 20), (attention.MASKED, "additive", 6)]
)
def test_kernels_equal_the_dense_mask_and_plan_once_per_forward(monkeypatch, kernel, made_by, steps):
    made = []
    real = getattr(attention, made_by)
    monkeypatch.setattr(attention, made_by, lambda *args: made.append(args) or real(*args))
    model = _llama()
    for step in range(steps):  # the document boundaries differ every step
        positions = _packed(step)
        ids = torch.randint(0, 97, positions.shape, generator=torch.Generator().manual_seed(step))
        dense_loss, dense_grads = _loss_and_grads(model, "sdpa", ids, positions)
        loss, grads = _loss_and_grads(model, kernel, ids, positions)
        torch.testing.assert_close(loss, dense_loss, rtol=1e-6, atol=0)
        for g, d in zip(grads, dense_grads):
            torch.testing.assert_close(g, d, rtol=1e-5, atol=1e-7)
    assert len(made) == steps  # two layers, one plan (or additive mask) per forward


@pytest.mark.parametrize("kernel", [attention.DOCUMENTS, attention.MASKED])
def test_documents_are_not_plain_causal_attention(kernel):
    """The check above can fail: plain causal attention over the same blocks gives another loss."""
    model = _llama()
    positions = _packed(1)
    ids = torch.randint(0, 97, positions.shape)
    loss, _ = _loss_and_grads(model, kernel, ids, positions)
    causal, _ = _loss_and_grads(model, "sdpa", ids, None)
    assert (loss - causal).abs() > 1e-3


def test_generate_prefill_with_padding_goes_to_sdpa():
    model = _llama().eval()
    ids = torch.randint(0, 97, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    for kernel in ("sdpa", attention.DOCUMENTS, attention.MASKED):
        model.set_attn_implementation(kernel)
        with torch.no_grad():
            logits[kernel] = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(logits[attention.DOCUMENTS][:, -1], logits["sdpa"][:, -1])
    torch.testing.assert_close(logits[attention.MASKED][:, -1], logits["sdpa"][:, -1])


def test_choices_on_cpu():
    llama = LlamaConfig()
    assert attention.implementation("auto", llama, False, 128) == attention.MASKED  # short blocks: one call is faster
    assert attention.implementation("auto", llama, False, 256) == attention.DOCUMENTS
    assert attention.implementation("auto", llama, False, 1024) == attention.DOCUMENTS
    assert attention.implementation("auto", FalconConfig(), False, 128) == "sdpa"  # no attention interface
    assert attention.implementation("varlen", llama, False, 128) == attention.DOCUMENTS
    assert attention.implementation("sdpa", llama, False, 1024) == "sdpa"
    assert attention.implementation("auto", Gemma2Config(), False, 1024) == "eager"  # soft-capping
    assert attention.implementation("auto", MistralConfig(sliding_window=64), False, 1024) == "sdpa"


@pytest.mark.parametrize(
    "choice, config, words",
    [
        ("flex", LlamaConfig(), "meshlm runs FlexAttention on CUDA only"),
        ("varlen", MistralConfig(sliding_window=64), "mistral's attention has a sliding window; use --attention flex"),
        ("varlen", Gemma2Config(), "gemma2's attention has soft-capped scores"),
    ],
)
def test_refusals_name_the_kernel_that_works(choice, config, words):
    with pytest.raises(MeshlmError, match=words):
        attention.implementation(choice, config, False, 1024)
