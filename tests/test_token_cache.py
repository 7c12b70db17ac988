"""The token cache is memory-mapped: a rank's resident memory does not grow with the corpus.

Two caches in meshlm's block format, 4 MB and 300 MB of tokens, each read by a fresh process the way a
rank reads it (Blocks + the distributed sampler, 50 batches); that process's anonymous RSS is measured.
Pages of the mapped file are counted apart by the kernel (RssFile): they live in the page cache, shared by
every rank on the node and dropped under memory pressure, and only the rows read (plus the kernel's
fault-around, 64 KB per fault) are ever mapped. The big
cache is written directly with numpy (tokenising 40M tokens through a tokenizer would take minutes);
what is under test is the reading side, which every rank runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SEQ = 512
READ = """
import sys, numpy as np
from pathlib import Path
from meshlm.data.pack import Blocks
from meshlm.data.sampler import ResumableSampler

def rss():  # anonymous resident memory: what the process owns (mapped file pages are the shared page cache)
    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1]) * 1024

def grown(directory):
    before = rss()
    blocks = Blocks(Path(directory))
    sampler = ResumableSampler(len(blocks), 4, 1, seed=0, batch_size=8)
    total = 0
    for i, idx in zip(range(50), sampler):
        total += int(blocks.batch(idx).ids.sum())
    return rss() - before

# the big corpus first: allocations made once (warm-up) count against it, not against the small one
print(grown(sys.argv[1]), grown(sys.argv[2]))
"""


def _cache(path, blocks: int):
    path.mkdir()
    row = np.arange(SEQ, dtype=np.int32)
    for name in ("ids", "labels", "positions"):
        np.broadcast_to(row, (blocks, SEQ)).tofile(path / f"{name}.bin")
    np.save(path / "pads.npy", np.zeros(blocks, np.int32))
    (path / "meta.json").write_text(
        json.dumps({"blocks": blocks, "seq_length": SEQ, "documents": blocks, "split": 0, "truncated": 0})
    )
    return path


def test_rss_does_not_grow_with_the_corpus(tmp_path):
    small_dir = _cache(tmp_path / "small", 2_000)  # 1M tokens per array
    big_dir = _cache(tmp_path / "big", 50_000)  # 26M tokens: 100 MB per array, 300 MB on disk
    assert sum(f.stat().st_size for f in big_dir.iterdir()) > 300e6
    p = subprocess.run(
        [sys.executable, "-c", READ, str(big_dir), str(small_dir)], capture_output=True, text=True, check=True
    )
    big, small = map(int, p.stdout.split())
    # Reading 50 batches copies only the rows they touch: a few MB either way, never the corpus
    # (loading it, as torch.load of the old cache did, would add ~300 MB here).
    assert big - small < 16e6, (small, big)
