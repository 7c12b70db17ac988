"""docs/ARCHITECTURE.md's module map matches src/meshlm: every module and package it names exists, and every
module of the tree is named there, so a moved or added module shows up as a list of names to fix."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "meshlm"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
MODULE = re.compile(r"(?<![\w./-])((?:[a-z_][a-z0-9_]*/)*[a-z_][a-z0-9_]*\.py)\b")
PACKAGE_BLOCK = re.compile(r"^`([a-z_]+)/`:")  # a paragraph on one package: its bare module names are its own
ELSEWHERE = ("tests/", "benchmarks/")  # named as tests or tools, not modules of the package


def tree() -> set[str]:
    """Every module under src/meshlm as a path relative to it; a package's __init__ and __main__ go unnamed."""
    return {
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts
    }


def packages() -> set[str]:
    return {p.parent.relative_to(SRC).as_posix() for p in SRC.rglob("__init__.py") if p.parent != SRC}


def named() -> tuple[set[str], set[str]]:
    """(modules, packages) ARCHITECTURE.md names. A bare `x.py` in a package's paragraph is that package's; a bare
    one elsewhere (the flow diagram, the top-level list, the tables) is a top-level module, or one of the only
    package that has it."""
    modules, pkgs, owner = set(), set(), ""
    everywhere = tree()
    for line in DOC.read_text().splitlines():
        block = PACKAGE_BLOCK.match(line)
        if block:
            owner = block.group(1)
        elif line.startswith("#") or line.startswith("Top level"):
            owner = ""
        pkgs.update(re.findall(r"`((?:[a-z_]+/)*[a-z_]+)/`", line))  # a nested package by its path
        for name in MODULE.findall(line):
            name = name.removeprefix("src/meshlm/")
            if name.startswith(ELSEWHERE):
                continue
            if "/" not in name and owner:
                name = f"{owner}/{name}"
            elif "/" not in name and name not in everywhere:
                homes = [m for m in everywhere if m.endswith("/" + name)]
                name = homes[0] if len(homes) == 1 else name
            modules.add(name)
    return modules, pkgs


def test_every_named_module_exists():
    modules, pkgs = named()
    extra, missing_pkgs = sorted(modules - tree()), sorted(packages() - pkgs)
    assert not extra and not missing_pkgs, (
        f"ARCHITECTURE.md names modules src/meshlm does not have: {extra}; "
        f"packages of src/meshlm it does not name (as `pkg/`): {missing_pkgs}"
    )


def test_every_module_is_named():
    missing = sorted(tree() - named()[0])
    assert not missing, f"modules of src/meshlm ARCHITECTURE.md does not name: {missing}"
