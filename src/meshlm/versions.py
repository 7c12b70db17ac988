"""The releases of torch and transformers meshlm runs on, stated once: `meshlm env` reports against them and every
other command refuses an older release at start-up (pyproject.toml states the same lower bounds).

OLDEST is the oldest release meshlm supports; NEWEST the newest one its tests have passed on. A newer release
than NEWEST is allowed (meshlm's seams, compat.py and compat_transformers.py, refuse a feature whose names it
lacks), and `meshlm env` says it is untested.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

from meshlm.errors import MeshlmError

OLDEST = {"torch": "2.11.0", "transformers": "5.17.0"}
NEWEST = {"torch": "2.15.0", "transformers": "5.24.0"}


def installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def tested(package: str) -> str:
    return f"{package} {_span(package)}"


def _span(package: str) -> str:
    return f"{OLDEST[package]} to {_minor(NEWEST[package])}.x"


def _minor(release: str) -> str:
    return ".".join(release.split(".")[:2])


def _release(found: str) -> Version:
    """The release number alone: torch's local build tag (+cpu, +cu130) says nothing about its API."""
    return Version(Version(found).base_version)


def standing(package: str) -> str:
    """Where the installed release stands against the tested range, in a few words."""
    found = installed(package)
    if found == "not installed":
        return found
    release = _release(found)
    if release < Version(OLDEST[package]):
        return f"older than the tested range, {_span(package)}"
    if release.release[:2] > Version(NEWEST[package]).release[:2]:
        return f"newer than the tested range, {_span(package)}"
    return f"inside the tested range, {_span(package)}"


def check() -> None:
    """One `meshlm: error:` line for a torch or transformers older than meshlm supports."""
    for package, oldest in OLDEST.items():
        found = installed(package)
        if found != "not installed" and _release(found) < Version(oldest):
            raise MeshlmError(
                f"meshlm needs {package} >= {oldest}; found {package} {found}: pip install '{package}>={oldest}'"
            )
