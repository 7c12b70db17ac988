"""The one guarded reader: every data, config, model and tokenizer file meshlm reads goes through here.

A file can be damaged in ways its parser reports in its own words, from deep inside: a byte that is not UTF-8,
JSON or TOML cut short, a record nested deeper than Python's recursion limit, a top level of the wrong type, a
safetensors file cut in half. Each becomes one MeshlmError naming the file (and its line where known) and what
to do, so a hostile or unlucky input is one line and exit 2 like any other mistake.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

from meshlm.errors import MeshlmError

_RESAVE = "repair it or write it again"


def read_bytes(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise MeshlmError(f"could not read {path}: {e.strerror or e}") from None


def decode(data: bytes, path: str | Path, line: int = 0) -> str:
    """`data` (the whole file, or its line `line`) as UTF-8 text, or one line naming where it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line or data[: e.start].count(b"\n") + 1
        raise MeshlmError(f"{path}:{line} is not UTF-8 text (byte 0x{data[e.start]:02x}); save it as UTF-8") from None


def read_text(path: str | Path) -> str:
    return decode(read_bytes(path), path)


def parse_json(text: str, path: str | Path, top: type | None = None, line: int = 0):
    """`text` (the file `path`, or its line `line`) parsed as JSON, its top level of type `top` when given."""
    where = f"{path}:{line}" if line else str(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        at = f"column {e.colno}" if line else f"line {e.lineno}, column {e.colno}"
        raise MeshlmError(f"{where} is not valid JSON ({e.msg}: {at}); {_RESAVE}") from None
    except RecursionError:
        raise MeshlmError(f"{where} is JSON nested too deeply to read; flatten it") from None
    if top is not None and not isinstance(value, top):
        raise MeshlmError(f"{where} holds a JSON {_json_name(type(value))}, not a JSON {_json_name(top)}; {_RESAVE}")
    return value


def read_json(path: str | Path, top: type | None = dict, need: tuple[str, ...] = ()):
    """A JSON file, its top level of type `top` (None: any), an object holding every key in `need`."""
    value = parse_json(read_text(path), path, top)
    missing = [k for k in need if k not in value]
    if missing:
        raise MeshlmError(f"{path} lacks {', '.join(map(repr, missing))}; {_RESAVE}")
    return value


def jsonl(path: str | Path, top: type | None = None) -> Iterator[tuple[int, object]]:
    """(line number, value) for each non-blank line of a JSON Lines file, read one line at a time."""
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if raw.strip():
                    yield n, parse_json(decode(raw, path, n), path, top, n)
    except OSError as e:
        raise MeshlmError(f"could not read {path}: {e.strerror or e}") from None


def read_toml(path: str | Path) -> dict:
    try:
        return tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as e:
        raise MeshlmError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise MeshlmError(f"config file {path} is TOML nested too deeply to read; flatten it") from None


@contextlib.contextmanager
def safetensors(path: str | Path):
    """safetensors' `safe_open` of `path` (PyTorch tensors); a file cut short or not safetensors at all is one line."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MeshlmError(f"{path} is not a readable safetensors file ({cause}); copy or save it again") from None
    with f:
        yield f


def can_write_dir(path: Path) -> bool:
    """Whether `path` is, or can be made, a directory that files can be written into. Tried by making (and at once
    removing) an empty directory in it or its nearest existing parent: permission bits say nothing to root, and a
    virtual file system such as /proc refuses whatever they say."""
    path = path.expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return False
    try:
        Path(tempfile.mkdtemp(prefix=".meshlm-probe-", dir=existing)).rmdir()
    except OSError:
        return False
    return True


def _json_name(t: type) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(t, "number")
