"""A user's JSONL for parity tests: short records that pack several to a block of 64 tokens, with responses
from one character to ~90, so blocks hold very different numbers of targets and later documents of a block
have targets (what catches attention or positions leaking across documents in any layout)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def uneven_records(d: Path | None = None) -> Path:
    path = Path(d or tempfile.gettempdir()) / "meshlm-tests-uneven-v1.jsonl"
    recs = [
        {"instruction": f"Repeat {w} {n} times.", "input": "", "output": " ".join([w] * n)}
        if i % 2
        else {"prompt": f"{w} has how many letters? ", "completion": str(len(w))}
        for i, (w, n) in enumerate((w, 1 + (i * 7) % 30) for i, w in enumerate(["ab", "tree", "xyzzy"] * 120))
    ]
    text = "\n".join(json.dumps(r) for r in recs)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path
