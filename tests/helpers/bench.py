"""Benchmark scripts loaded by path, for the tests that exercise a script itself (benchmarks/ stays off sys.path).

A script imports its siblings by module name, as `python benchmarks/NAME.py` lets it; those are loaded first, by
path, under the same names, so that the script's own imports find them."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (loaded once; its sibling imports before it)."""
    if name in sys.modules:
        return sys.modules[name]
    path = BENCHMARKS / f"{name}.py"
    for sibling in siblings(path):
        if sibling != name:
            script(sibling)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def siblings(path: Path) -> list[str]:
    """The benchmarks/ modules `path` imports, anywhere in its text."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return sorted(n for n in names if (BENCHMARKS / f"{n}.py").is_file())
