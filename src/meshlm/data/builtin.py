"""The embedded default: a synthetic instruction corpus and a byte-level tokenizer.

Nothing is downloaded. Records follow the Alpaca layout (instruction / input /
output) and carry learnable structure (arithmetic, copying, reversing, sorting, repeating),
so the loss of a tiny model falls quickly and visibly.
"""

from __future__ import annotations

import random
import string
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS, PAD = "<|eos|>", "<|pad|>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens + eos + pad: any text encodes, no vocabulary file needed."""
    # transformers imported here, not with the corpus: the launcher checks the data source without it (~1 CPU s)
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def _word(rng: random.Random, lo=3, hi=8) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def _record(rng: random.Random) -> dict:
    kind = rng.randrange(6)
    if kind == 5:  # long responses next to one-digit sums: very uneven target counts per block
        w, n = _word(rng, 2, 5), rng.randint(2, 12)
        return {"instruction": f"Repeat the word {n} times.", "input": w, "output": " ".join([w] * n)}
    if kind == 0:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
    if kind == 1:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        a, b = max(a, b), min(a, b)
        return {
            "instruction": "Subtract the second number from the first.",
            "input": f"{a} - {b}",
            "output": str(a - b),
        }
    if kind == 2:
        w = " ".join(_word(rng) for _ in range(rng.randint(1, 4)))
        return {"instruction": "Copy the text exactly.", "input": w, "output": w}
    if kind == 3:
        w = _word(rng, 4, 12)
        return {"instruction": "Reverse the letters.", "input": w, "output": w[::-1]}
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
    return {
        "instruction": "Sort the numbers in ascending order.",
        "input": " ".join(map(str, xs)),
        "output": " ".join(map(str, sorted(xs))),
    }


def corpus(n: int, seed: int = 0) -> list[dict]:
    """n Alpaca-style records, the same for the same (n, seed) on every machine."""
    rng = random.Random(seed)
    return [_record(rng) for _ in range(n)]
