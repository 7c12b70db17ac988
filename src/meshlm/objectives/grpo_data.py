"""--objective grpo's prompts: each record's prompt (`prompt`, an Alpaca instruction, or chat `messages` through the
tokenizer's template), encoded once, with the record's other fields kept for the reward functions. Without
--dataset-name, the built-in corpus's tasks (data/builtin.py) with their exact answers (`answer`: the output the
supervised run learned)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from meshlm.errors import MeshlmError
from meshlm.objectives.grpo_rewards import NEEDS

OWN = ("prompt", "messages", "instruction", "input")  # what makes the prompt, not a column


@dataclass
class Prompts:
    texts: list[str]  # each prompt as the model reads it
    ids: list[list[int]]  # its tokens
    columns: list[dict]  # its record's other fields
    where: list[str]  # "FILE record N": what an error names
    tokenizer: object

    def __len__(self) -> int:
        return len(self.ids)

    def identity(self) -> dict:
        """What tells these prompts from others: a resumed run on other prompts starts a new epoch."""
        h = hashlib.sha256(repr((self.ids, self.columns)).encode())
        return {"blocks": len(self), "digest": h.hexdigest()[:16]}

    def describe(self) -> str:
        lengths = [len(t) for t in self.ids]
        return f"{len(self)} prompts of {min(lengths)} to {max(lengths)} tokens"


def _wanted(cfg, rec: dict) -> bool:
    """Whether --grpo.tasks (the built-in corpus's tasks to prompt with; empty: all) keeps the record."""
    from meshlm.data.builtin import task_of

    tasks = {t.strip() for t in cfg.grpo.tasks.split(",") if t.strip()}
    return not tasks or task_of(rec) in tasks


def _columns(rec: dict) -> dict:
    cols = {k: v for k, v in rec.items() if k not in OWN}
    if "answer" not in cols and "output" in rec:  # Alpaca records: their output is the answer
        cols["answer"] = rec["output"]
    return cols


def load_prompts(cfg, tokenizer, held_out: bool = False) -> Prompts:
    """Every training record's prompt (or held-out record's: --eval-fraction, --eval-split), encoded and checked to
    leave --grpo.max-new-tokens in --seq-length, and the fields the chosen built-in rewards read present in each."""
    from meshlm.data.load import split_records
    from meshlm.infer.prompts import prompt_of, render

    texts, columns, where = [], [], []
    for held, rec, at in split_records(cfg):
        if held != held_out or not _wanted(cfg, rec):
            continue
        texts.append(prompt_of(rec, at))
        columns.append(_columns(rec))
        where.append(at)
    if not texts:
        held = " held-out" if held_out else ""
        fix = ": raise --eval-fraction or give --eval-split" if held_out else ""
        raise MeshlmError(f"{cfg.dataset_name or 'the built-in corpus'} holds no{held} prompts{fix}")
    rendered, templated = render(texts, tokenizer)
    room = cfg.seq_length - cfg.grpo.max_new_tokens
    ids = []
    for text, t, at in zip(rendered, templated, where):
        tokens = tokenizer(text, add_special_tokens=not t)["input_ids"]
        if not tokens or len(tokens) > room:
            raise MeshlmError(
                f"{at}: its prompt has {len(tokens)} tokens; --seq-length {cfg.seq_length} leaves {room} beside "
                f"--grpo.max-new-tokens {cfg.grpo.max_new_tokens}: raise --seq-length or shorten the prompt"
            )
        ids.append(tokens)
    _check_columns(cfg, columns, where)
    return Prompts(rendered, ids, columns, where, tokenizer)


def _check_columns(cfg, columns: list[dict], where: list[str]) -> None:
    names = [n.strip() for n in cfg.grpo.reward.split(",")]
    for name in names:
        field = NEEDS.get(name)
        missing = next((w for c, w in zip(columns, where) if field and field not in c), None)
        if missing:
            raise MeshlmError(f"{missing}: --grpo.reward {name} needs an '{field}' field in every prompt record")


def check_prompts(cfg) -> None:
    """The launcher's check before any rank starts: the prompts load, the reward functions import with TRL's
    signature, and a global batch's prompts are there."""
    from meshlm.config import check_grpo_tiling
    from meshlm.data.load import check_enough_blocks
    from meshlm.models.build import load_tokenizer
    from meshlm.objectives.grpo_rewards import rewards_of

    check_grpo_tiling(cfg)
    rewards_of(cfg)
    tokenizer, _ = load_tokenizer(cfg)
    check_enough_blocks(cfg, len(load_prompts(cfg, tokenizer)), cfg.global_batch_size // cfg.grpo.group_size)
    if cfg.eval_every:
        load_prompts(cfg, tokenizer, held_out=True)


class Replay:
    """--grpo.replay: the completions an earlier run wrote to completions.jsonl (its "index" and member order),
    trained on instead of generating, so that runs compare on the same tokens (meshlm verify's layouts)."""

    def __init__(self, path: str, eos: list[int]):
        import json

        self.path, self.eos = path, set(eos)
        self.groups: dict[tuple[int, int], list[list[int]]] = {}
        for line in open(path, encoding="utf-8"):
            if line.strip():
                row = json.loads(line)
                if "index" not in row:
                    raise MeshlmError(f"--grpo.replay {path} has rows without a prompt index: write it again")
                self.groups.setdefault((row["step"], row["index"]), []).append(row["token_ids"])

    def group(self, step: int, index: int, size: int) -> list[tuple[list[int], bool]]:
        """The `size` completions of record `index` at `step` (1-based): (tokens, ended with EOS) each."""
        found = self.groups.get((step, index), [])
        if len(found) != size:
            raise MeshlmError(
                f"--grpo.replay {self.path} holds {len(found)} completions of record {index} at step {step}, not "
                f"{size}: replay a run of the same prompts, seed, batch and --grpo.group-size"
            )
        return [(t, bool(t) and t[-1] in self.eos) for t in found]
