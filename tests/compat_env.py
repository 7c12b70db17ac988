"""The environment `make test-compat` runs meshlm's tests in, for another release of transformers (and torch), built
once into a cache directory and reused.

With the project's own torch, only transformers changes: a `pip install --target` overlay of that release, and of
those of its requirements the project's environment does not satisfy (transformers 5.17 wants huggingface_hub
below 2), put first on PYTHONPATH; nothing of the project's environment changes. With another torch (a multi-GB
build, not for CI): a virtual environment of its own. Prints the python to run and the PYTHONPATH to put first.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def _found(name: str, target: Path) -> str | None:
    for path in ([str(target)], sys.path):
        dist = next(iter(importlib.metadata.distributions(name=name, path=path)), None)
        if dist is not None:
            return dist.version
    return None


def _unsatisfied(target: Path) -> list[str]:
    """Requirements of the overlay's packages that neither the overlay nor this environment satisfies."""
    wanted = []
    for dist in importlib.metadata.distributions(path=[str(target)]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            found = _found(req.name, target)
            if found is None or not req.specifier.contains(found, prereleases=True):
                wanted.append(str(req).split(";")[0])
    return sorted(set(wanted))


def overlay(cache: Path, transformers: str) -> Path:
    target = cache / f"transformers-{transformers}"
    if not (target / ".complete").exists():
        _pip(sys.executable, "--no-deps", "--target", str(target), f"transformers=={transformers}")
        for _ in range(3):  # a requirement's own requirements, a level at a time
            missing = _unsatisfied(target)
            if not missing:
                break
            _pip(sys.executable, "--no-deps", "--upgrade", "--target", str(target), *missing)
        (target / ".complete").touch()
    return target


def full_venv(cache: Path, torch: str, transformers: str) -> Path:
    where = cache / f"torch-{torch}-transformers-{transformers}"
    python = where / "bin" / "python"
    if not (where / ".complete").exists():
        venv.create(where, with_pip=True, clear=True)
        _pip(str(python), f"torch=={torch}")  # first, as the Makefile's install: pip then keeps this build
        # the build backend the project names: a new venv's bundled setuptools may predate it
        build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
        _pip(str(python), f"torch=={torch}", f"transformers=={transformers}", *build, f"{ROOT}[dev]")
        (where / ".complete").touch()
    return python


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--torch", required=True)
    p.add_argument("--transformers", required=True)
    a = p.parse_args()
    here = importlib.metadata.version("torch").split("+")[0]
    if a.torch == here:
        print(sys.executable)
        print(overlay(a.cache, a.transformers))
    else:
        print(full_venv(a.cache, a.torch, a.transformers))
        print("")


if __name__ == "__main__":
    main()
