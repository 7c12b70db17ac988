"""Records, loss masks and packing, in process: packed documents see only themselves, prompts are not learned."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from meshlm import config as config_mod
from meshlm.data import builtin
from meshlm.data.batch import IGNORE
from meshlm.data.pack import Blocks, BlockWriter, labels_of
from meshlm.data.records import encode
from meshlm.errors import MeshlmError
from meshlm.parallel.loss import token_loss_sum

CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=300,
            n_embd=64,
            n_layer=2,
            n_head=4,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_implementation="sdpa",
        )
    ).eval()


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_a_packed_documents_logits_equal_its_logits_alone(tmp_path, make):
    model = make()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (11, 7, 5)]
    w = BlockWriter(tmp_path, 24, pad_id=0, packing=True, overflow="split")
    for d in docs:
        w.add(d, [True] * len(d))
    w.close()
    b = Blocks(tmp_path).batch([0]).to("cpu")
    assert b.pad_tokens == 1
    with torch.no_grad():
        # No KV cache (training has none): with a cache, transformers does not look for packed documents.
        packed = model(input_ids=b.ids, position_ids=b.positions, use_cache=False).logits[0]
        # one causal sequence: later documents see earlier ones
        plain = model(input_ids=b.ids, use_cache=False).logits[0]
        start = 0
        for d in docs:
            alone = model(input_ids=torch.tensor([d])).logits[0]
            torch.testing.assert_close(packed[start : start + len(d)], alone, rtol=1e-5, atol=1e-5)
            if start:
                assert not torch.allclose(plain[start : start + len(d)], alone, rtol=1e-3, atol=1e-3)
            start += len(d)


def _loss(model, ids, labels):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    return token_loss_sum(logits, torch.tensor([labels])).item()


def test_loss_on_response_ignores_the_prompt_and_counts_the_response():
    tok, model = builtin.byte_tokenizer(), _llama()
    rec = {"instruction": "Reverse the letters.", "input": "abcdef", "output": "fedcba"}
    ids, learned = encode(rec, tok, "response", "r")
    first = learned.index(True)
    assert tok.decode(ids[first:]) == "fedcba<|eos|>" and not any(learned[:first])
    base = _loss(model, ids, labels_of(ids, learned))
    # What the prompt positions would be asked to predict changes nothing ...
    other_prompt = [(t + 7) % 256 if i < first else t for i, t in enumerate(ids)]
    assert _loss(model, ids, labels_of(other_prompt, learned)) == base
    # ... a different response token changes the loss.
    other_response = list(ids)
    other_response[first + 2] = (ids[first + 2] + 7) % 256
    assert _loss(model, ids, labels_of(other_response, learned)) != base
    # loss-on all learns every token but the first.
    _, all_learned = encode(rec, tok, "all", "r")
    assert all(all_learned)


def test_chat_records_learn_the_assistant_turns_only():
    tok = builtin.byte_tokenizer()
    tok.chat_template = CHAT
    rec = {
        "messages": [
            {"role": "system", "content": "Be short."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"},
        ]
    }
    ids, learned = encode(rec, tok, "response", "c")
    assert tok.decode(ids) == (
        "<system>Be short.<|eos|><user>2+2?<|eos|><assistant>4<|eos|><user>3+3?<|eos|><assistant>6<|eos|>"
    )
    assert tok.decode([t for t, k in zip(ids, learned) if k]) == "<assistant>4<|eos|><assistant>6<|eos|>"


def test_prompt_completion_and_text_records():
    tok = builtin.byte_tokenizer()
    ids, learned = encode({"prompt": "Q: hi\nA:", "completion": " yo"}, tok, "response", "p")
    assert tok.decode([t for t, k in zip(ids, learned) if k]) == " yo<|eos|>"
    ids, learned = encode({"text": "plain"}, tok, "response", "t")
    assert tok.decode(ids) == "plain<|eos|>" and all(learned)  # plain text learns every token


def test_bad_records_and_options_are_one_line_errors():
    tok = builtin.byte_tokenizer()
    with pytest.raises(
        MeshlmError,
        match=r"r 3: a record of unknown shape: found fields \['answer', 'question'\]; "
        r"expected Alpaca",
    ):
        encode({"question": "q", "answer": "a"}, tok, "response", "r 3")
    with pytest.raises(MeshlmError, match="chat records need a tokenizer with a chat template"):
        encode({"messages": [{"role": "user", "content": "x"}]}, tok, "response", "c")
    tok.chat_template = CHAT
    with pytest.raises(MeshlmError, match="message 2 has role 'robot'; expected one of system, user, assistant"):
        encode({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}, tok, "all", "c")
    for bad in ("0.6", "-0.1", "1"):
        with pytest.raises(MeshlmError, match=r"--eval-fraction must be in \(0, 0.5\]"):
            config_mod.load(None, [("eval-fraction", bad)])
    assert config_mod.load(None, [("batch-size", "64")]).micro_batch_size == 64  # the classic recipe's flag


def test_truncate_keeps_one_block_and_padding_is_never_learned(tmp_path):
    w = BlockWriter(tmp_path, 4, pad_id=9, packing=False, overflow="truncate")
    w.add([1, 2, 3, 4, 5, 6], [True] * 6)
    w.add([7, 8], [True, True])
    assert w.close()["truncated"] == 1
    b = Blocks(tmp_path).batch([0, 1])
    assert b.ids.tolist() == [[1, 2, 3, 4], [7, 8, 9, 9]]
    assert b.labels.tolist() == [[IGNORE, 2, 3, 4], [IGNORE, 8, IGNORE, IGNORE]]


def test_a_cache_another_job_put_in_place_first_is_kept(tmp_path):
    """Two jobs packing the same data at once: the one that renames second keeps the first's cache (the same
    input packs to the same blocks) instead of failing on the rename, and leaves no temporary directory."""
    from meshlm.data.pack import write_atomically

    target = tmp_path / "blocks"

    def fill(name):
        def write(tmp):
            tmp.mkdir()
            (tmp / "meta.json").write_text(name)
            return {"by": name}

        return write

    assert write_atomically(target, fill("first")) == {"by": "first"}
    assert write_atomically(target, fill("second")) == {"by": "second"}
    assert (target / "meta.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocks"]


def _documents(blocks: Blocks) -> list[list[int]]:
    """Each block's documents (a new one where the position restarts), padding (id 0) left out, block by block."""
    b = blocks.batch(range(len(blocks)))
    out = []
    for ids, positions in zip(b.ids.tolist(), b.positions.tolist()):
        docs: list[list[int]] = []
        for t, p in zip(ids, positions):
            if p == 0:
                docs.append([])
            docs[-1].append(t)
        out.append([d for d in docs if d[0] != 0])
    return out


def test_best_fit_packs_every_document_once_in_fewer_blocks(tmp_path):
    """Lengths 6 5 4 5 3 2 into blocks of 10: next fit in file order made 4 blocks ([6] [5 4] [5 3] [2]); best
    fit makes 3, each written as soon as it is full, every document whole, once, with its own labels."""
    lengths = [6, 5, 4, 5, 3, 2]
    docs = [[10 * (i + 1) + j for j in range(n)] for i, n in enumerate(lengths)]
    w = BlockWriter(tmp_path, 10, pad_id=0, packing=True, overflow="split")
    for d in docs:
        w.add(d, [True] * len(d))
    assert w.close()["blocks"] == 3
    blocks = Blocks(tmp_path)
    assert _documents(blocks) == [[docs[0], docs[2]], [docs[1], docs[3]], [docs[4], docs[5]]]
    assert blocks.pads.tolist() == [0, 0, 5] and blocks.padding() == 5 / 30
    labels = blocks.batch([2]).labels[0].tolist()
    assert labels == [IGNORE, 51, 52, IGNORE, 61] + [IGNORE] * 5  # each document's first token is no target


def test_past_the_open_blocks_the_fullest_is_written_first(tmp_path):
    """With two blocks open, a document that fits neither writes the fuller one (padded) and opens a third."""
    w = BlockWriter(tmp_path, 10, pad_id=0, packing=True, overflow="split")
    w.most_open = 2
    docs = [[11] * 7, [22] * 5, [33] * 6, [44] * 3, [55] * 2]  # 7: A (3 left), 5: B (5 left), 6: A written, C
    for d in docs:  # 3: C (1 left, the best fit), 2: B; closing writes B and C in the order they opened
        w.add(d, [True] * len(d))
    w.close()
    assert _documents(Blocks(tmp_path)) == [[docs[0]], [docs[1], docs[4]], [docs[2], docs[3]]]
    assert sorted(map(tuple, sum(_documents(Blocks(tmp_path)), []))) == sorted(map(tuple, docs))
