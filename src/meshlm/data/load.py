"""Load records (built-in, local file, or hub dataset), tokenise them into documents, pack them into blocks.

The blocks are cached on disk (data/pack.py: memory-mapped files) keyed by everything that changes them,
written by rank 0 first (`rank0_first`) so other ranks and later runs only map them. `datasets` is imported
only when a hub dataset (or a dataset directory) is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshlm import files
from meshlm.config import Config
from meshlm.data import builtin
from meshlm.data.pack import Blocks, BlockWriter, write_atomically
from meshlm.errors import MeshlmError
from meshlm.runtime import log, rank0_first

CACHE_VERSION = 4  # bump when what the blocks hold changes (3: no block without a target; 4: best-fit packing)


def cache_dir() -> Path:
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm"))


def _read_txt(path: Path, unit: str) -> Iterator[dict]:
    """A .txt file is one document, or one per blank-line-separated paragraph (--text-unit)."""
    text = files.read_text(path)
    parts = [text] if unit == "file" else re.split(r"\n\s*\n", text)
    for part in parts:
        if part.strip():
            yield {"text": part.strip("\n")}


def _read_json(path: Path) -> Iterator[dict]:
    if path.suffix == ".jsonl":
        yield from (rec for _, rec in files.jsonl(path))
        return
    recs = files.read_json(path, (dict, list))
    if isinstance(recs, dict):
        recs = next((v for v in recs.values() if isinstance(v, list)), [recs])
    yield from recs


def _read_local(path: Path, unit: str) -> Iterator[dict]:
    if path.suffix == ".txt":
        return _read_txt(path, unit)
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path)
    raise MeshlmError(f"--dataset-name {path}: use a .jsonl, .json or .txt file, or a hub dataset id")


def open_dataset(name: str, split: str, streaming: bool = False):
    """datasets' split `split` of `name`: a hub id, a directory of data files, or a directory `save_to_disk` wrote
    (read with load_from_disk, memory-mapped: streaming changes nothing there; a single Dataset has no splits)."""
    import datasets  # lazily: meshlm trains on local and built-in data without it

    p = Path(name)
    if (p / "state.json").is_file():
        return datasets.load_from_disk(name)
    if (p / "dataset_dict.json").is_file():
        splits = datasets.load_from_disk(name)
        if split not in splits:
            raise MeshlmError(f"it holds the splits {', '.join(splits)}, not {split!r}")
        return splits[split]
    return datasets.load_dataset(name, split=split, streaming=streaming)


def _read_hub(name: str, split: str, streaming: bool) -> Iterator[dict]:
    try:
        ds = open_dataset(name, split, streaming)
    except Exception as e:  # the hub, the network, or a typo: all a user problem here
        raise MeshlmError(f"could not load dataset {name!r} (split {split!r}): {str(e).splitlines()[0]}") from None
    return iter(ds)


def dataset_source(cfg: Config) -> tuple[str, str]:
    """(kind, fingerprint) of the dataset, checked to exist before anything runs."""
    name = cfg.dataset_name
    if not name:
        return "builtin", f"builtin:{builtin.CORPUS_VERSION}:{cfg.builtin_samples}:{cfg.seed}"
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


def records(cfg: Config, split: str = "") -> Iterator[dict]:
    """The dataset's records in file order (split: another split of a hub dataset)."""
    kind, _ = dataset_source(cfg)
    if kind == "builtin":
        made = builtin.preference_corpus if cfg.objective == "dpo" else builtin.corpus
        return iter(made(cfg.builtin_samples, cfg.seed))
    if kind == "local":
        return _read_local(Path(cfg.dataset_name), cfg.text_unit)
    return _read_hub(cfg.dataset_name, split or cfg.dataset_split, cfg.streaming)


def split_records(cfg: Config) -> Iterator[tuple[bool, dict, str]]:
    """(held out, record, where) for every record: the training records, a held-out fraction of them, then the
    records of --eval-split, all held out."""
    rng = np.random.default_rng(cfg.seed)  # one draw per record, in order: the same split on every run
    where = cfg.dataset_name or "builtin"
    for i, rec in enumerate(records(cfg)):
        yield bool(cfg.eval_fraction and rng.random() < cfg.eval_fraction), rec, f"{where} record {i + 1}"
    if cfg.eval_split:
        for i, rec in enumerate(records(cfg, cfg.eval_split)):
            yield True, rec, f"{where}[{cfg.eval_split}] record {i + 1}"


def _tokenise_into(cfg: Config, tokenizer, directory: Path) -> dict:
    """Every record, encoded, into train/ (and eval/: a held-out fraction of records, or --eval-split)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    train, held = (
        BlockWriter(directory / part, cfg.seq_length, pad, cfg.packing, cfg.overflow) for part in ("train", "eval")
    )
    add = _adder(cfg)
    for held_out, rec, where in split_records(cfg):
        add(held if held_out else train, rec, tokenizer, cfg, where)
    return {"train": train.close(), "eval": held.close()}


def _add_document(out: BlockWriter, rec, tokenizer, cfg: Config, where: str) -> None:
    from meshlm.data.records import encode  # only where a corpus is tokenised: the ranks map the launcher's cache

    out.add(*encode(rec, tokenizer, cfg.loss_on, where))


def _adder(cfg: Config):
    """How one record is added: a document, or (dpo) a preference pair; preference.py is imported only then."""
    if cfg.objective != "dpo":
        return _add_document
    from meshlm.data.preference import pair_documents

    def add_pair(out: BlockWriter, rec, tokenizer, cfg: Config, where: str) -> None:
        pair = pair_documents(rec, tokenizer, where)
        out.add_together(pair, f"{where}: the pair (prompt + chosen, prompt + rejected)")

    return add_pair


def cache_key(cfg: Config, tokenizer_id: str, vocab: int) -> str:
    _, fingerprint = dataset_source(cfg)
    parts = (
        CACHE_VERSION,
        fingerprint,
        tokenizer_id,
        vocab,
        cfg.seq_length,
        cfg.loss_on,
        cfg.packing,
        cfg.overflow,
        cfg.text_unit,
        cfg.eval_fraction,
        cfg.eval_split,
        cfg.seed if cfg.eval_fraction else 0,
        *["pairs"] * (cfg.objective == "dpo"),  # sft keys stay as they were
    )
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:20]


def blocks_dir(cfg: Config, tokenizer_id: str, vocab: int) -> Path:
    return cache_dir() / "blocks" / cache_key(cfg, tokenizer_id, vocab)


def cached_blocks(cfg: Config) -> int | None:
    """How many training blocks the cache holds for cfg's data with the built-in tokenizer (None: not cached,
    or another tokenizer), read without building the tokenizer: what the launcher needs when an earlier run
    already packed (and so checked) the data."""
    if cfg.tokenizer_name or cfg.model_name:
        return None
    meta = blocks_dir(cfg, builtin.TOKENIZER_ID, builtin.VOCAB) / "train" / "meta.json"
    return json.loads(meta.read_text())["blocks"] if meta.is_file() else None


def load_data(cfg: Config, tokenizer, tokenizer_id: str) -> tuple[Blocks, Blocks | None]:
    """(training blocks, held-out blocks or None), memory-mapped from the cache; rank 0 writes it first."""
    path = blocks_dir(cfg, tokenizer_id, len(tokenizer))
    with rank0_first(local=True):
        if not path.exists():
            if not files.can_write_dir(cache_dir()):
                raise MeshlmError(
                    f"the cache {cache_dir()} cannot be created or written (under a file, or on a read-only or "
                    f"virtual file system); set MESHLM_CACHE to a writable directory"
                )
            log.info(f"tokenising {cfg.dataset_name or 'the built-in corpus'} into blocks of {cfg.seq_length}")
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda tmp: _tokenise_into(cfg, tokenizer, tmp))
    train, held = Blocks(path / "train"), Blocks(path / "eval")
    if cfg.eval_every and not len(held):
        raise MeshlmError("--eval-every: the held-out part is empty; raise --eval-fraction or use more records")
    return train, (held if len(held) else None)


def describe(cfg: Config, blocks: Blocks) -> str:
    """How the documents became blocks (from the cache's record of it, so every run says it, not only the first)."""
    t = blocks.meta
    return (
        f"{t['documents']} documents -> {t['blocks']} blocks of {cfg.seq_length} tokens "
        f"({'packed' if cfg.packing else 'padded'}, {blocks.padding():.1%} padding); longer than a block: "
        f"{t['split']} split, {t['truncated']} truncated; {t['no_target']} documents or pieces without a target "
        "token dropped"
    )


def check_enough_blocks(cfg: Config, blocks: int, global_batch: int) -> None:
    if blocks < global_batch:
        raise MeshlmError(
            f"the dataset has {blocks} blocks of {cfg.seq_length} tokens, fewer than one global batch of "
            f"{global_batch}; use more data or a smaller --micro-batch-size/--seq-length"
        )
