"""Preference records -> pairs of documents that share their prompt (TRL's layout and tokenisation).

Shapes, as TRL's preference datasets:
- explicit prompt: `prompt`, `chosen`, `rejected`, each a string, or each a list of {role, content}
  messages (the prompt is the conversation so far, chosen and rejected the assistant's turns);
- implicit prompt: `chosen` and `rejected` only; the prompt is their longest common beginning
  (whole messages of a conversation, characters of a text).

Tokenised as TRL's DPOTrainer does: prompt, prompt + chosen and prompt + rejected each go through the
tokenizer (the chat template for conversations, with the generation prompt for the prompt alone); a
text response ends with the EOS token's text. The prompt is the longest beginning the three share, so
chosen and rejected see the same prompt tokens; only the response tokens are learned. A pair becomes two
documents, prompt + chosen then prompt + rejected, placed in one block together (data/pack.py): a pair is
never split over blocks, ranks or micro-batches.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from meshlm.data.records import ROLES
from meshlm.errors import MeshlmError

SHAPE = "'chosen' and 'rejected' (and optionally 'prompt'), strings or lists of {role, content} messages"


def _conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _split_prompt(rec: dict) -> dict:
    """TRL's extract_prompt: the longest common beginning of chosen and rejected is the prompt."""
    chosen, rejected = rec["chosen"], rec["rejected"]
    idx = 0
    while idx < min(len(chosen), len(rejected)) and chosen[idx] == rejected[idx]:
        idx += 1
    if isinstance(chosen, str) and idx < min(len(chosen), len(rejected)) and idx and chosen[idx - 1] == " ":
        idx -= 1  # the space belongs to the response, as TRL keeps it
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _check(rec, where: str) -> dict:
    if not isinstance(rec, dict):
        raise MeshlmError(f"{where}: expected a JSON object per record, got {type(rec).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in rec]
    if missing:
        raise MeshlmError(
            f"{where}: --objective dpo needs preference records; this one has no {' or '.join(map(repr, missing))} "
            f"(found fields {sorted(rec)[:8]}; expected {SHAPE})"
        )
    rec = rec if "prompt" in rec else _split_prompt(rec)
    texts = [isinstance(rec[k], str) for k in ("prompt", "chosen", "rejected")]
    chats = [
        isinstance(rec[k], list) and (not rec[k] or _conversational(rec[k])) for k in ("prompt", "chosen", "rejected")
    ]
    if not (all(texts) or all(chats)):
        raise MeshlmError(f"{where}: prompt, chosen and rejected must all be strings or all lists of {{role, content}}")
    for k in ("chosen", "rejected"):
        value = rec[k]
        if not (value.strip() if isinstance(value, str) else any(str(m.get("content") or "").strip() for m in value)):
            raise MeshlmError(f"{where}: the '{k}' response is empty; every pair needs two non-empty responses")
    return rec


def _tokenize(tokenizer, value, where: str, generation_prompt: bool = False) -> list[int]:
    if isinstance(value, str):
        return list(tokenizer(text=value)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise MeshlmError(
            f"{where}: conversational pairs need a tokenizer with a chat template; this one has none "
            f"(use --tokenizer-name with an instruct model's tokenizer, or text pairs)"
        )
    for k, msg in enumerate(value, 1):
        if msg.get("role") not in ROLES:
            raise MeshlmError(f"{where}: message {k} has role {msg.get('role')!r}; expected one of {', '.join(ROLES)}")
    out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_pair(rec, tokenizer, where: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one preference record, tokenised as TRL does."""
    rec = _check(rec, where)
    prompt, chosen, rejected = rec["prompt"], rec["chosen"], rec["rejected"]
    if isinstance(chosen, str):
        eos = tokenizer.eos_token or ""
        chosen, rejected = (r if r.endswith(eos) else r + eos for r in (chosen, rejected))
    prompt_ids = _tokenize(tokenizer, prompt, where, generation_prompt=True) if prompt != [] else []
    with_chosen = _tokenize(tokenizer, prompt + chosen, where)
    with_rejected = _tokenize(tokenizer, prompt + rejected, where)
    n = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    chosen_ids, rejected_ids = with_chosen[n:], with_rejected[n:]
    if not chosen_ids or not rejected_ids:
        raise MeshlmError(f"{where}: a response adds no tokens to the prompt; every pair needs two non-empty responses")
    return prompt_ids[:n], chosen_ids, rejected_ids


def pair_documents(rec, tokenizer, where: str) -> list[tuple[list[int], list[bool]]]:
    """The pair as two documents, (ids, learned?) each: prompt + chosen, then prompt + rejected."""
    prompt, chosen, rejected = encode_pair(rec, tokenizer, where)
    return [(prompt + r, [False] * len(prompt) + [True] * len(r)) for r in (chosen, rejected)]


class ReferenceLogps:
    """--dpo.precompute-reference in the cache: every block's pairs' reference log-probabilities (chosen,
    rejected), `logps.npy` float32 [pairs, 2] in block order and `offsets.npy` (block b's pairs are
    offsets[b]:offsets[b + 1]), memory-mapped: a batch reads only its blocks' rows."""

    def __init__(self, directory: Path):
        self.offsets = np.load(directory / "offsets.npy", mmap_mode="r")
        self.logps = np.load(directory / "logps.npy", mmap_mode="r")

    def rows(self, idx, seq_length: int) -> torch.Tensor:
        """[len(idx), pairs, 2] as objectives/dpo_loss.py lays a batch's pairs out (zeros past a row's last pair)."""
        out = np.zeros((len(idx), (seq_length + seq_length % 2) // 2, 2), dtype=np.float32)
        for i, b in enumerate(idx):
            a, z = self.offsets[b], self.offsets[b + 1]
            out[i, : z - a] = self.logps[a:z]
        return torch.from_numpy(out)

    @staticmethod
    def write(directory: Path, found: dict[int, np.ndarray], blocks: int) -> None:
        """Block -> its pairs' [pairs, 2] log-probabilities, written whole or not at all (another writer may
        have been first)."""
        counts = np.array([len(found[b]) for b in range(blocks)], dtype=np.int64)
        logps = np.concatenate([found[b] for b in range(blocks)] or [np.zeros((0, 2))]).astype(np.float32)
        tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(counts)]))
        np.save(tmp / "logps.npy", logps.reshape(-1, 2))
        try:
            os.replace(tmp, directory)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
