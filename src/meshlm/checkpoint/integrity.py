"""A checkpoint's integrity: the checksum of every file, written at save and checked before it is trusted.

MANIFEST.json (beside the COMPLETE marker) maps each file of checkpoints/step-N, by its path inside it, to
its size and sha256. The ranks share the work: rank r hashes the files whose position in the sorted list is
r modulo the world size, at save (and flushes them to disk with os.fsync in the same pass: `latest` must
not move before the bytes it points at are durable) and again before resuming. Every rank learns every
rank's answer (all_gather_object), so a rank that finds damage never leaves another waiting. A checkpoint
written before manifests existed has none and is trusted as it is.

Also which step a run's `latest` (or `best`) names: a pointer out of the run is refused before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch.distributed as dist

from meshlm import files
from meshlm.errors import MeshlmError
from meshlm.runtime import Runtime

MANIFEST = "MANIFEST.json"
MARKER = "COMPLETE"  # written last into checkpoints/step-N (checkpoint/store.py): a step without it is partial


def step_named_by_latest(root: Path, pointer_name: str = "latest") -> Path | None:
    """The directory checkpoints/latest (or another pointer: best) names, or None without it. The name must be a
    step-N directly inside `root`: a pointer such as ../../elsewhere (a copied or tampered run) is refused."""
    pointer = root / pointer_name
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not re.fullmatch(r"step-\d+", name):
        raise MeshlmError(
            f"{pointer} names {name!r}, not a step-N directory inside {root}; "
            f"write the name of a complete step-N there or remove it"
        )
    return root / name


def _files(step_dir: Path) -> list[str]:
    """Every file of the checkpoint but the manifest and the marker, by its path inside step_dir, sorted."""
    names = (str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())
    return sorted(n for n in names if n not in (MANIFEST, MARKER))


def _digest(path: Path, sync: bool) -> dict:
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
        if sync:
            os.fsync(f.fileno())
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": sha}


def _gather(mine):
    """Every rank's value, in rank order ([mine] alone outside a job)."""
    if not dist.is_initialized():
        return [mine]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (the names of what was created or renamed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir: Path, rt: Runtime) -> None:
    """Hash and flush this rank's share of the files; rank 0 writes the manifest of all of them, flushed,
    with the directories. Every rank must have finished writing its files (the save's agreement)."""
    names = _files(step_dir)
    try:
        mine = {n: _digest(step_dir / n, sync=True) for n in names[rt.rank :: rt.world_size]}
    except OSError as e:  # said by every rank, after the gather: none may be left waiting in it
        mine = f"could not write checkpoint {e.filename}: {e.strerror or e}; free space or fix permissions"
    every = _gather(mine)
    failed = next((m for m in every if isinstance(m, str)), None)
    if failed:
        raise MeshlmError(failed)
    if rt.is_main:
        manifest = {k: v for part in every for k, v in part.items()}
        with open(step_dir / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for d in {(step_dir / n).parent for n in names} | {step_dir}:
            fsync_dir(d)


def _check_share(step_dir: Path, share: dict) -> str | None:
    reason = _size_mismatch(step_dir, share)
    for name in sorted(share) if reason is None else ():
        try:
            if _digest(step_dir / name, sync=False)["sha256"] != share[name]["sha256"]:
                return f"{step_dir / name} does not match its checksum (changed after the save)"
        except OSError as e:
            return f"{step_dir / name} cannot be read ({e.strerror or e})"
    return reason


def read_manifest(step_dir: Path) -> dict | str | None:
    """The manifest, None for a checkpoint written without one, or the reason it cannot be used."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = files.read_json(path, dict)
    except MeshlmError as e:
        return str(e).split(";")[0]
    if not manifest or not all(isinstance(v, dict) and {"bytes", "sha256"} <= v.keys() for v in manifest.values()):
        return f"{path} is not a manifest of files, sizes and checksums"
    return manifest


def _size_mismatch(step_dir: Path, manifest: dict) -> str | None:
    for name, v in sorted(manifest.items()):
        path = step_dir / name
        size = path.stat().st_size if path.is_file() else None
        if size != v["bytes"]:
            return f"{path} is missing" if size is None else f"{path} has {size} bytes, the save wrote {v['bytes']}"
    return None


def damage(step_dir: Path, deep: bool = True, alone: bool = False) -> str | None:
    """Why the files of a complete checkpoint cannot be trusted (one clause naming a file), or None. With deep,
    every file is hashed, shared among the ranks of the job (every rank must call this), the answer being every
    rank's; with alone, by this process alone (export, `generate --checkpoint`); without deep, sizes only (the
    launcher's look before any rank starts)."""
    manifest = read_manifest(step_dir)
    if not isinstance(manifest, dict):
        return manifest
    if not deep:
        return _size_mismatch(step_dir, manifest)
    if alone or not dist.is_initialized():
        return _check_share(step_dir, manifest)
    share = {n: manifest[n] for n in sorted(manifest)[dist.get_rank() :: dist.get_world_size()]}
    return next((r for r in _gather(_check_share(step_dir, share)) if r), None)
