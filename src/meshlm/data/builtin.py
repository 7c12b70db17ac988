"""The embedded default: a synthetic instruction corpus and a byte-level tokenizer.

Nothing is downloaded. Records follow the Alpaca layout (instruction / input /
output) and carry learnable structure (arithmetic, copying, reversing, sorting, repeating, majority),
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
TOKENIZER_ID, VOCAB = "builtin-bytes", 258  # byte_tokenizer's name in caches, and its size: known without building it
CORPUS_VERSION = 2  # bump when corpus() or preference_corpus() makes other records: cached blocks are keyed by it


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


def _record(rng: random.Random, kinds: int = 7) -> dict:
    kind = rng.randrange(kinds)
    if kind == 6:  # the answer follows every input letter, so a short supervised run already half-answers it
        w = "".join(rng.choice("ab") for _ in range(rng.choice((3, 5, 7, 9, 11))))
        return {"instruction": "Majority letter: a or b?", "input": w, "output": max("ab", key=w.count)}
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


def task_of(rec: dict) -> str:
    """A built-in record's task, its instruction's first word in lower case: one of config.BUILTIN_TASKS, the
    names --grpo.tasks takes."""
    return rec["instruction"].split()[0].lower()


def corpus(n: int, seed: int = 0) -> list[dict]:
    """n Alpaca-style records, the same for the same (n, seed) on every machine."""
    rng = random.Random(seed)
    return [_record(rng) for _ in range(n)]


def _mistake(rec: dict, rng: random.Random) -> str:
    """A plausible wrong response: a number off by a little, letters or words out of order, a word too many."""
    out = rec["output"]
    if out.lstrip("-").isdigit():
        return str(int(out) + rng.choice([-1, 1]) * rng.randint(1, 9))
    words = out.split(" ")
    if len(words) > 1:
        return " ".join(words[:-1] if rng.random() < 0.5 else [*words, words[-1]])
    return out[::-1] if out[::-1] != out else out + out[-1]


def _short_prompt(rec: dict) -> str:
    """The task in a few bytes ("add: 12 + 7 =", "repeat 3x: ab ="), so a pair fits the default block."""
    verb = rec["instruction"].split()[0].lower()
    if verb == "repeat":
        verb = f"repeat {rec['instruction'].split()[3]}x"
    return f"{verb}: {rec['input']} ="


def preference_corpus(n: int, seed: int = 0) -> list[dict]:
    """n preference records (prompt, chosen, rejected) for --objective dpo: a task of the corpus above with a short
    prompt, its right response as chosen and a plausible mistake as rejected (responses of 1 to 24 bytes, so a pair
    fits in a block of 128 byte tokens)."""
    rng, wrong = random.Random(seed), random.Random(seed + 1)
    out: list[dict] = []
    while len(out) < n:
        rec = _record(rng, kinds=6)  # the six tasks the preference corpus was first made of: its data unchanged
        if len(rec["output"]) <= 24:
            out.append(
                {"prompt": _short_prompt(rec), "chosen": " " + rec["output"], "rejected": " " + _mistake(rec, wrong)}
            )
    return out
