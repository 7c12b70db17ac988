"""Load text (built-in, local file, or hub dataset), tokenise, and cut into blocks.

The result is cached on disk keyed by everything that changes it, written by
rank 0 first (`rank0_first`) so other ranks and later runs only read it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from meshlm.config import Config
from meshlm.data import builtin
from meshlm.errors import MeshlmError
from meshlm.runtime import log, rank0_first

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def cache_dir() -> Path:
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm"))


def format_prompt(rec: dict) -> str:
    """The Alpaca prompt, without the response: what generation is given."""
    if rec.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=rec["instruction"], input=rec["input"])
    return PROMPT.format(instruction=rec["instruction"])


def record_text(rec: dict, path: str) -> str:
    """One training text: Alpaca records become prompt + response; a `text` field is used as is."""
    if "instruction" in rec and "output" in rec:
        return format_prompt(rec) + str(rec["output"])
    if "text" in rec:
        return str(rec["text"])
    raise MeshlmError(f"records in {path} need a 'text' field or Alpaca 'instruction'/'output' fields; "
                      f"found {sorted(rec)[:6]}")


def _read_local(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        recs = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    raise MeshlmError(f"{path}:{i} is not valid JSON") from None
    elif path.suffix == ".json":
        try:
            recs = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise MeshlmError(f"{path} is not valid JSON: {e}") from None
        if isinstance(recs, dict):
            recs = next((v for v in recs.values() if isinstance(v, list)), [recs])
    else:
        raise MeshlmError(f"--dataset-name {path}: use a .jsonl, .json or .txt file, or a hub dataset id")
    return [record_text(r, str(path)) for r in recs if isinstance(r, dict)]


def _read_hub(name: str, split: str) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub, the network, or a typo: all a user problem here
        raise MeshlmError(f"could not load dataset {name!r} (split {split!r}): {str(e).splitlines()[0]}") from None
    return [record_text(r, name) for r in ds]


def dataset_source(cfg: Config) -> tuple[str, str]:
    """(kind, fingerprint) of the dataset, checked to exist before anything runs."""
    name = cfg.dataset_name
    if not name:
        return "builtin", f"builtin:{cfg.builtin_samples}:{cfg.seed}"
    p = Path(name)
    if p.is_dir():  # a dataset directory (data files, or a hub dataset cloned locally): datasets reads it
        stamp = max((f.stat().st_mtime_ns for f in p.rglob("*") if f.is_file()), default=0)
        return "hub", f"dir:{p.resolve()}:{stamp}:{cfg.dataset_split}"
    if p.exists():
        st = p.stat()
        return "local", f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if name.endswith((".jsonl", ".json", ".txt")) or name.startswith((".", "/", "~")):
        raise MeshlmError(f"dataset file {name} does not exist")
    return "hub", f"hub:{name}:{cfg.dataset_split}"


def texts(cfg: Config) -> list[str]:
    kind, _ = dataset_source(cfg)
    if kind == "builtin":
        return [record_text(r, "builtin") for r in builtin.corpus(cfg.builtin_samples, cfg.seed)]
    if kind == "local":
        return _read_local(Path(cfg.dataset_name))
    return _read_hub(cfg.dataset_name, cfg.dataset_split)


def tokenize_blocks(all_texts: list[str], tokenizer, seq_length: int) -> torch.Tensor:
    """Concatenate texts (each followed by EOS) and cut into [n, seq_length] blocks; the ragged tail is dropped."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for start in range(0, len(all_texts), 1000):
        for row in tokenizer(all_texts[start:start + 1000], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            if eos is not None:
                ids.append(eos)
    n = len(ids) // seq_length
    return torch.tensor(ids[: n * seq_length], dtype=torch.int32).view(n, seq_length)


def load_blocks(cfg: Config, tokenizer, tokenizer_id: str) -> torch.Tensor:
    """Token blocks for training, from the cache when it has them."""
    _, fingerprint = dataset_source(cfg)
    key = hashlib.sha256(f"{fingerprint}|{tokenizer_id}|{len(tokenizer)}|{cfg.seq_length}".encode()).hexdigest()[:20]
    path = cache_dir() / "blocks" / f"{key}.pt"
    with rank0_first(local=True):
        if not path.exists():
            log.info(f"tokenising {cfg.dataset_name or 'the built-in corpus'} into blocks of {cfg.seq_length}")
            blocks = tokenize_blocks(texts(cfg), tokenizer, cfg.seq_length)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(blocks, tmp)
            os.replace(tmp, path)  # readers never see half a file
    return torch.load(path, weights_only=True)
