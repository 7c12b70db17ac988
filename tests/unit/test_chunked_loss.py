"""The chunked loss in one process: equal to the whole-logits loss and its gradients (1e-10 relative, in fp64), for
an untied Llama head and GPT-2's head tied to its embedding, and which settings chunk."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from meshlm.data.batch import IGNORE
from meshlm.parallel.loss import (
    ChunkedLossHead,
    apply_chunked_loss,
    chunk_tokens,
    next_token_targets,
    targets_loss_sum,
    token_loss_sum,
)

VOCAB = 1000


def _llama():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    return LlamaForCausalLM(cfg)


def _gpt2():
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # both runs must draw the same (no) dropout
    return GPT2LMHeadModel(cfg)


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, :40] = IGNORE  # a prompt that is not learned
    labels[1, 100:130] = IGNORE
    return labels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("make", [_llama, _gpt2])
@pytest.mark.parametrize("chunk", [37, 256])
def test_chunked_loss_equals_the_whole_logits_loss(make, chunk):
    """In fp64: at this random initialisation attention is nearly uniform, and the q / k gradients, a small
    difference of large terms, magnify an fp32 rounding difference a thousandfold. In fp32 the whole-logits
    reference itself came out 1.3e-4 (max-relative) away from its fp64 value in about 1 process of 5, the chunked
    loss 6e-7, which failed a 1e-6 comparison at random."""
    torch.manual_seed(0)
    model = make().double()
    ids = torch.randint(0, VOCAB, (2, 200))
    labels = _labels(ids)
    whole = token_loss_sum(model(input_ids=ids, use_cache=False).logits, labels)
    whole.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    chunked = copy.deepcopy(model)
    chunked.zero_grad()
    head = apply_chunked_loss(chunked, chunk)
    assert isinstance(chunked.get_output_embeddings(), ChunkedLossHead)
    assert (head.weight is chunked.get_input_embeddings().weight) == (make is _gpt2)  # a tie stays a tie
    with head.computing_loss(next_token_targets(labels)):
        loss = chunked(input_ids=ids, use_cache=False).logits
    loss.backward()
    assert loss.dtype == torch.float64 and abs(loss.item() - whole.item()) / whole.item() <= 1e-10
    for name, p in chunked.named_parameters():
        assert _rel(p.grad, want[name]) <= 1e-10, name
    # outside computing_loss the head gives logits again (generation, export)
    assert torch.equal(chunked(input_ids=ids[:, :8], use_cache=False).logits, model(input_ids=ids[:, :8]).logits)


def test_next_token_targets_cut_anywhere():
    labels = torch.arange(10).reshape(1, 10)
    assert next_token_targets(labels).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, IGNORE]]


def test_which_settings_chunk():
    vocab = 32768
    per_chunk = (1 << 24) // vocab
    assert chunk_tokens("auto", vocab, 8192) == per_chunk  # 8k tokens span 16 chunks: saves memory
    assert chunk_tokens("auto", vocab, per_chunk) == 0  # one chunk would be the whole logits
    assert chunk_tokens("auto", 256, 4096) == 0  # a byte vocabulary: 4k tokens' logits are one chunk
    assert chunk_tokens("off", vocab, 1 << 20) == 0
    assert chunk_tokens("on", 256, 64) == (1 << 24) // 256
    assert chunk_tokens("300", vocab, 64) == 300
    # a fused head (plain weight, its hidden size given): one chunk of the micro-batch's tokens where its logits
    # [tokens, vocab] are no smaller than the kept fp32 weight gradient [vocab, hidden]
    assert chunk_tokens("auto", 4096, 1024, fused_hidden=256) == 1024  # an Alpaca-like job: 8 x 128 tokens
    assert chunk_tokens("auto", 4096, 512, fused_hidden=4096) == 0  # the gradient would outweigh the logits
    assert chunk_tokens("auto", vocab, 8192, fused_hidden=256) == per_chunk
    assert chunk_tokens("off", vocab, 1024, fused_hidden=256) == 0


def test_the_head_runs_once_per_token():
    """The fused chunked loss makes the gradients in forward: forward and backward together run the head's
    [tokens x vocabulary] matmul once per chunk (the checkpointed chunks ran it twice: forward and recompute)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class VocabMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == VOCAB:
                VocabMatmuls.count += 1
            return out

    torch.manual_seed(0)
    model = _llama()
    head = apply_chunked_loss(model, 50)
    ids = torch.randint(0, VOCAB, (2, 100))
    with VocabMatmuls(), head.computing_loss(next_token_targets(ids)):
        model(input_ids=ids, use_cache=False).logits.backward()
    assert VocabMatmuls.count == 4  # 200 tokens, 4 chunks of 50
    with torch.no_grad(), head.computing_loss(next_token_targets(ids)):  # evaluation: no gradients made
        assert model(input_ids=ids, use_cache=False).logits.grad_fn is None


def test_positions_without_a_target_make_no_logits():
    """The fused head's logits are made only for positions with a target (a prompt's are not learned): the
    vocabulary matmuls cover the targets' rows alone, and loss and gradients equal the whole logits' (1e-6)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class VocabRows(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == VOCAB:
                VocabRows.rows += out.shape[0]
            return out

    torch.manual_seed(0)
    model = _llama()
    ids = torch.randint(0, VOCAB, (2, 200))
    labels = _labels(ids)
    targets = next_token_targets(labels)
    whole = token_loss_sum(model(input_ids=ids, use_cache=False).logits, labels)
    whole.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    head = apply_chunked_loss(model, 400)
    with VocabRows(), head.computing_loss(targets):
        loss = model(input_ids=ids, use_cache=False).logits
        loss.backward()
    assert VocabRows.rows == int((targets != IGNORE).sum()) == 400 - 39 - 30 - 2  # a row's last position has none
    assert abs(loss.item() - whole.item()) / whole.item() <= 1e-6
    for name, p in model.named_parameters():
        assert _rel(p.grad, want[name]) <= 1e-6, name


def test_the_fused_loss_holds_two_chunks_at_most():
    """Forward and backward of the fused loss hold at most one chunk's logits and its log-probabilities (made into
    the gradient in place) at once, as the planner counts (plan/activations.py _head_parts); the previous chunk's
    gradient is freed before the next chunk's logits are made (it was not: a third chunk, 64 MiB per rank at the
    head's peak). Measured by torch's MemTracker (as `--measure-step`) on a head whose chunks dwarf everything else
    it holds."""
    from meshlm.compat import MemTracker

    vocab, hidden, tokens, chunk = 4096, 8, 256, 64  # a chunk of logits: 1 MiB; the rest of the loss's: ~0.2 MiB
    torch.manual_seed(0)
    head = ChunkedLossHead.of(torch.nn.Linear(hidden, vocab, bias=False), chunk)
    x = torch.randn(tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    tracker = MemTracker()
    tracker.track_external(head, x)
    with tracker, head.computing_loss(targets):
        head(x).backward()
    peak = tracker.get_tracker_snapshot("peak")[x.device]
    one_chunk = chunk * vocab * 4
    made = sum(v for k, v in peak.items() if str(k).endswith((".ACT", ".TEMP")))  # activations, temporaries
    assert 2 * one_chunk <= made < 2.5 * one_chunk, made / one_chunk


def test_a_micro_batch_without_targets_sums_to_zero():
    """Every position a prompt's (no target): the head's loss is 0, with and without gradients (a pipeline's
    evaluation sums it with the other micro-batches'; it returned None, which the schedule could not take)."""
    torch.manual_seed(0)
    head = ChunkedLossHead.of(torch.nn.Linear(8, VOCAB, bias=False), 16)
    x = torch.randn(40, 8, requires_grad=True)
    none = torch.full((40,), IGNORE)
    with torch.no_grad(), head.computing_loss(none):
        assert head(x).item() == 0.0
    with head.computing_loss(none):
        loss = head(x)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(head.weight.grad) == 0


def test_a_bf16_hidden_gradient_is_scaled_in_fp32():
    """The loss's gradient (dp / targets, here 1/3) multiplies the fused head's bf16 hidden-state gradient in fp32.
    Rounded to bf16 first, 1/3 is 0.2% high, and so was every element of a micro-batch's hidden gradient: its slope
    against the fp32 gradient was 1.0024 here where the whole-logits bf16 head's is 1.0009 (its bf16 logits); now
    1.0005."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(256, 64), torch.randn(VOCAB, 64) / 8
    targets = torch.randint(0, VOCAB, (256,))

    def hidden_grad(dtype, fused: bool) -> torch.Tensor:
        h = hidden.clone().to(dtype).requires_grad_()
        w = torch.nn.Parameter(weight.clone().to(dtype))
        if fused:
            head = ChunkedLossHead.of(torch.nn.Linear(64, VOCAB, bias=False), 64)
            head.weight = w
            with head.computing_loss(targets):
                (head(h) / 3).backward()
        else:
            (targets_loss_sum(torch.nn.functional.linear(h, w), targets) / 3).backward()
        return h.grad.float()

    want = hidden_grad(torch.float32, False)
    torch.testing.assert_close(hidden_grad(torch.float32, True), want, rtol=1e-5, atol=1e-7)
    fused, plain = ((g * want).sum() / (want * want).sum() for g in (hidden_grad(torch.bfloat16, f) for f in (1, 0)))
    assert abs(fused - plain) < 5e-4, (fused.item(), plain.item())
