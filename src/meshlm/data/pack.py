"""Documents -> blocks of seq_length tokens, written to memory-mapped files.

Packing (the default) puts whole documents one after another into a block while they fit, then pads the
block's rest and starts the next; position ids restart at each document (the model's mask then keeps
attention inside it, see data/batch.py). `packing false` gives each document its own padded block. A
document longer than a block is split into block-sized pieces (each trained on as its own document) or
truncated to one block (overflow "truncate"); the log says how many. A document or piece without a target
token (a piece of a long prompt, under --loss-on response) teaches nothing and is dropped, so every block holds
a target: a step can never train on nothing.

Blocks are appended to flat files as they are made (ids, labels, positions: int32 [n, seq_length]) and
mapped read-only afterwards, so no rank ever holds the corpus in memory, however large.
"""

from __future__ import annotations

import errno
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


class BlockWriter:
    """Packs documents into blocks and appends them to <dir>/{ids,labels,positions}.bin."""

    def __init__(self, directory: Path, seq_length: int, pad_id: int, packing: bool, overflow: str):
        self.dir, self.L, self.pad_id, self.packing, self.overflow = directory, seq_length, pad_id, packing, overflow
        directory.mkdir(parents=True, exist_ok=True)
        self.files = {n: open(directory / f"{n}.bin", "wb") for n in FILES}
        self.pads: list[int] = []  # padding positions per block (small: one int per block)
        self.stats = {"documents": 0, "split": 0, "truncated": 0, "no_target": 0}
        self._new_block()

    def _new_block(self) -> None:
        self.ids, self.labels, self.positions = [], [], []

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
        """Documents that must share one block (a preference pair): into the current block, or all into a new one."""
        n = sum(len(ids) for ids, _ in docs)
        if n > self.L:
            raise MeshlmError(
                f"{what} is {n} tokens ({' + '.join(str(len(ids)) for ids, _ in docs)}), longer than a block of "
                f"--seq-length {self.L}; raise --seq-length or leave such records out"
            )
        self.stats["documents"] += len(docs)
        self._make_room(n)
        for ids, learned in docs:
            self._append(ids, labels_of(ids, learned))

    def _place(self, ids: list[int], learned: list[bool]) -> None:
        labels = labels_of(ids, learned)
        if all(label == IGNORE for label in labels):
            self.stats["no_target"] += 1
            return
        self._make_room(len(ids))
        self._append(ids, labels)

    def _make_room(self, n: int) -> None:
        if self.ids and (not self.packing or len(self.ids) + n > self.L):
            self._flush()

    def _append(self, ids: list[int], labels: list[int]) -> None:
        self.ids += ids
        self.labels += labels
        self.positions += range(len(ids))

    def _flush(self) -> None:
        pad = self.L - len(self.ids)
        rows = {
            "ids": self.ids + [self.pad_id] * pad,
            "labels": self.labels + [IGNORE] * pad,
            "positions": self.positions + list(range(pad)),
        }  # padding: a document of its own, never learned
        for name, row in rows.items():
            self.files[name].write(np.asarray(row, dtype=np.int32).tobytes())
        self.pads.append(pad)
        self._new_block()

    def close(self) -> dict:
        if self.ids:
            self._flush()
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
