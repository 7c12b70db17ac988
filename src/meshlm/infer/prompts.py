"""Read prompts (.jsonl, .txt, or a hub / local dataset split) and turn them into token ids that fit the model."""

from __future__ import annotations

import contextlib
from pathlib import Path

from meshlm import files
from meshlm.data.records import format_prompt
from meshlm.errors import MeshlmError

HOW = (
    "a .jsonl file (a 'prompt' field, or Alpaca 'instruction'/'input'), a .txt file (one prompt per line) "
    "or a dataset id / directory with --prompts-split"
)


def prompt_of(rec, where: str) -> str:
    """A record's prompt: its 'prompt' field, or an Alpaca instruction (+ input) formatted exactly as in training."""
    if not isinstance(rec, dict):
        raise MeshlmError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "prompt" in rec:
        return str(rec["prompt"])
    if "instruction" in rec:
        return format_prompt(rec)
    raise MeshlmError(
        f"{where}: records need a 'prompt' field or an Alpaca 'instruction' (and optional 'input'); "
        f"found {sorted(rec)[:6]}"
    )


def _read_jsonl(path: Path) -> list[str]:
    return [prompt_of(rec, f"{path}:{n}") for n, rec in files.jsonl(path)]


@contextlib.contextmanager
def _no_progress_bars(datasets):
    """datasets' progress bars off while the prompts load (rank 0's summary reports progress); datasets' switch
    is process-wide, so it is put back afterwards."""
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _read_dataset(name: str, split: str) -> list[str]:
    import datasets

    from meshlm.data.load import open_dataset

    try:
        with _no_progress_bars(datasets):
            ds = open_dataset(name, split)
    except Exception as e:  # the hub, the network, a typo in the split: all the user's to fix
        raise MeshlmError(
            f"could not load prompts from dataset {name!r} (split {split!r}): "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        ) from None
    return [prompt_of(rec, f"{name}[{split}] row {i}") for i, rec in enumerate(ds)]


def read_prompts(source: str, split: str = "train") -> list[str]:
    """All prompts in file order. Blank lines of .txt/.jsonl files are skipped; an empty result is an error."""
    if not source:
        raise MeshlmError(f"--prompts is required: {HOW}")
    p = Path(source)
    if p.is_file():
        if p.suffix == ".jsonl":
            prompts = _read_jsonl(p)
        elif p.suffix == ".txt":
            prompts = [line for line in files.read_text(p).splitlines() if line.strip()]
        else:
            raise MeshlmError(f"--prompts {source}: use {HOW}")
    elif p.is_dir():
        prompts = _read_dataset(source, split)
    elif p.suffix in (".jsonl", ".txt", ".json") or source.startswith((".", "/", "~")):
        raise MeshlmError(f"prompts file {source} does not exist")
    else:
        prompts = _read_dataset(source, split)
    if not prompts:
        raise MeshlmError(f"--prompts {source} holds no prompts")
    return prompts


def encode(
    prompts: list[str], tokenizer, max_positions: int | None, max_new_tokens: int, truncate: bool
) -> tuple[list[list[int]], list[bool]]:
    """Token ids per prompt, and whether each was cut. A prompt plus its new tokens must fit the model's positions;
    with truncate, a prompt that does not keeps its last tokens (those next to the answer)."""
    ids = tokenizer(prompts)["input_ids"]
    room = None if max_positions is None else max_positions - max_new_tokens
    if room is not None and room < 1:
        raise MeshlmError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
            f"{max_positions} positions; use --max-new-tokens {max_positions - 1} or less"
        )
    cut = []
    for i, t in enumerate(ids):
        if not t:
            raise MeshlmError(f"prompt {i} is empty (no tokens); remove it from the prompts")
        too_long = room is not None and len(t) > room
        if too_long and not truncate:
            raise MeshlmError(
                f"prompt {i} has {len(t)} tokens; with --max-new-tokens {max_new_tokens} it needs "
                f"{len(t) + max_new_tokens} positions but the model has {max_positions}: shorten it, "
                f"lower --max-new-tokens, or pass --truncate to keep its last {room} tokens"
            )
        if too_long:
            ids[i] = t[-room:]
        cut.append(too_long)
    return ids, cut
