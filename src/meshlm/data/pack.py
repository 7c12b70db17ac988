"""Documents -> blocks of seq_length tokens, written to memory-mapped files.

Packing (the default) puts each whole document into the open block it fills best (best fit among up to 64
blocks being filled; the fullest is padded and written when a document fits none and no more may open);
position ids restart at each document (the model's mask then keeps attention inside it, see data/batch.py).
`packing false` gives each document its own padded block. A document longer than a block is split into
block-sized pieces (each trained on as its own document) or truncated to one block (overflow "truncate"); the
log says how many. A document or piece without a target token (a piece of a long prompt, under --loss-on
response) teaches nothing and is dropped, so every block holds a target: a step can never train on nothing.

Blocks are appended to flat files as they are made (ids, labels, positions: int32 [n, seq_length]) and
mapped read-only afterwards, so no rank ever holds the corpus in memory, however large.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from meshlm.data.batch import IGNORE, Batch
from meshlm.errors import MeshlmError

FILES = ("ids", "labels", "positions")


def labels_of(ids: list[int], learned: list[bool]) -> list[int]:
    """A document's labels: its tokens where learned, else IGNORE. Its first token is never a target:
    nothing of this document precedes it."""
    return [IGNORE] + [t if keep else IGNORE for t, keep in zip(ids[1:], learned[1:])]


OPEN_TOKENS = 1 << 22  # what the open blocks of a writer hold at most: 48 MiB of int32 ids, labels and positions
MOST_OPEN = 64  # open blocks a document may go into (benchmarks/packing.py: more packs no tighter)


class _Open:
    """A block being filled: its ids, labels and positions so far (int32 [3, L]) and how many tokens it holds."""

    def __init__(self, seq_length: int):
        self.rows, self.used = np.empty((3, seq_length), dtype=np.int32), 0

    def room(self) -> int:
        return self.rows.shape[1] - self.used

    def append(self, ids: list[int], labels: list[int]) -> None:
        end = self.used + len(ids)
        self.rows[:, self.used : end] = (ids, labels, range(len(ids)))
        self.used = end


class BlockWriter:
    """Packs documents into blocks (best fit among the open ones) and appends them to
    <dir>/{ids,labels,positions}.bin."""

    def __init__(self, directory: Path, seq_length: int, pad_id: int, packing: bool, overflow: str):
        self.dir, self.L, self.pad_id, self.packing, self.overflow = directory, seq_length, pad_id, packing, overflow
        directory.mkdir(parents=True, exist_ok=True)
        self.files = {n: open(directory / f"{n}.bin", "wb") for n in FILES}
        self.pads: list[int] = []  # padding positions per block (small: one int per block)
        self.stats = {"documents": 0, "split": 0, "truncated": 0, "no_target": 0}
        self.open: list[_Open] = []  # in the order they were opened (min() keeps the first of equals)
        self.most_open = max(1, min(MOST_OPEN, OPEN_TOKENS // seq_length)) if packing else 1

    def add(self, ids: list[int], learned: list[bool]) -> None:
        if not ids:
            return
        self.stats["documents"] += 1
        if len(ids) > self.L:
            self.stats["split" if self.overflow == "split" else "truncated"] += 1
            pieces = range(0, len(ids), self.L) if self.overflow == "split" else [0]
            for a in pieces:
                self._place(ids[a : a + self.L], learned[a : a + self.L])
        else:
            self._place(ids, learned)

    def add_together(self, docs: list[tuple[list[int], list[bool]]], what: str) -> None:
        """Documents that must share one block (a preference pair): all into the same block."""
        n = sum(len(ids) for ids, _ in docs)
        if n > self.L:
            raise MeshlmError(
                f"{what} is {n} tokens ({' + '.join(str(len(ids)) for ids, _ in docs)}), longer than a block of "
                f"--seq-length {self.L}; raise --seq-length or leave such records out"
            )
        self.stats["documents"] += len(docs)
        block = self._block_for(n)
        for ids, learned in docs:
            block.append(ids, labels_of(ids, learned))
        self._written_if_full(block)

    def _place(self, ids: list[int], learned: list[bool]) -> None:
        labels = labels_of(ids, learned)
        if all(label == IGNORE for label in labels):
            self.stats["no_target"] += 1
            return
        block = self._block_for(len(ids))
        block.append(ids, labels)
        self._written_if_full(block)

    def _block_for(self, n: int) -> _Open:
        """Best fit: the open block with the least room that still takes n tokens (the first opened of equals),
        else a new one; past `most_open` open blocks the fullest is written (padded) to make way. Next fit in file
        order left a fifth of an Alpaca-like corpus as padding at 1024 tokens, best fit among 64 open blocks 3%
        (benchmarks/packing.py)."""
        fits = [b for b in self.open if b.room() >= n] if self.packing else []
        if fits:
            return min(fits, key=_Open.room)
        if len(self.open) == self.most_open:
            self._write(min(self.open, key=_Open.room))
        block = _Open(self.L)
        self.open.append(block)
        return block

    def _written_if_full(self, block: _Open) -> None:
        if not self.packing or block.room() == 0:
            self._write(block)

    def _write(self, block: _Open) -> None:
        """The block out, its rest padding: a document of its own, never learned."""
        pad = block.room()
        block.append([self.pad_id] * pad, [IGNORE] * pad)
        for name, row in zip(FILES, block.rows):
            self.files[name].write(row.tobytes())
        self.pads.append(pad)
        self.open.remove(block)

    def close(self) -> dict:
        for block in list(self.open):
            self._write(block)
        for f in self.files.values():
            f.close()
        np.save(self.dir / "pads.npy", np.asarray(self.pads, dtype=np.int32))
        meta = {"blocks": len(self.pads), "seq_length": self.L, **self.stats}
        (self.dir / "meta.json").write_text(json.dumps(meta))
        return meta


class Blocks:
    """Memory-mapped blocks: indexing reads only the rows asked for."""

    reference = None  # --dpo.precompute-reference: data/preference.py ReferenceLogps, read with each batch

    def __init__(self, directory: Path):
        self.dir = directory
        self.meta = json.loads((directory / "meta.json").read_text())
        shape = (self.meta["blocks"], self.meta["seq_length"])
        self.arrays = {
            n: np.memmap(directory / f"{n}.bin", dtype=np.int32, mode="r", shape=shape)
            if shape[0]
            else np.zeros(shape, np.int32)
            for n in FILES
        }
        self.pads = np.load(directory / "pads.npy")

    def __len__(self) -> int:
        return self.meta["blocks"]

    def identity(self) -> dict:
        """What tells these blocks from others (a changed dataset, tokenizer or packing), cheaply: their count and a
        digest of the packing's record, each block's padding, and the first and last blocks' tokens."""
        h = hashlib.sha256(json.dumps(self.meta, sort_keys=True).encode())
        h.update(self.pads.tobytes())
        if len(self):
            h.update(np.ascontiguousarray(self.arrays["ids"][[0, -1]]).tobytes())
        return {"blocks": len(self), "digest": h.hexdigest()[:16]}

    def padding(self) -> float:
        """The fraction of the blocks' positions that are padding."""
        return float(self.pads.sum()) / max(1, self.pads.size * self.meta["seq_length"])

    def ids(self) -> torch.Tensor:
        """Every block's token ids, read into memory (benchmarks that bring their own training loop)."""
        return torch.from_numpy(np.array(self.arrays["ids"]))

    def batch(self, idx) -> Batch:
        idx = np.asarray(idx, dtype=np.int64)
        ids, labels, positions = (torch.from_numpy(np.ascontiguousarray(self.arrays[n][idx])) for n in FILES)
        reference = self.reference.rows(idx, self.meta["seq_length"]) if self.reference is not None else None
        return Batch(ids, labels, positions, int(self.pads[idx].sum()), reference)


def write_atomically(directory: Path, fill) -> dict:
    """Run fill(BlockWriter-making function) into a temporary directory, then rename it into place:
    readers never see half a cache. When another process (a second job on the same data) put the same cache
    in place first, its copy is kept and this one dropped: the same input packs to the same blocks."""
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        meta = fill(tmp)
    except BaseException:  # bad input found while tokenising: leave no half cache behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, directory)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not directory.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return meta
