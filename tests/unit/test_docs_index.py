"""A reader can navigate the docs: docs/README.md indexes every page, and every relative link in docs/ and
README.md reaches an existing file and, where it names one, a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def prose(path: Path) -> str:
    """The page without its fenced code blocks, where brackets and parentheses are code, not links."""
    out, code = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            code = not code
        elif not code:
            out.append(line)
    return "\n".join(out)


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    count: dict[str, int] = {}
    for line in prose(path).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = count.get(base, 0)
            count[base] = n + 1
            found.add(f"{base}-{n}" if n else base)  # a repeated heading gets -1, -2, ... as on GitHub
    return found


def broken(path: Path, generated: bool) -> list[str]:
    """Links of `path` that miss (a file, or a heading of it); `generated`: only links into BENCHMARKS.md, whose
    headings its renderer writes, else every other link."""
    out = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if (dest.name == "BENCHMARKS.md") != generated:
            continue
        if not dest.exists():
            out.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{path.relative_to(ROOT)}: {target} (no such heading in {dest.name})")
    return out


def test_the_index_links_every_page():
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in links(DOCS / "README.md")}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link: {missing}"


def test_every_relative_link_resolves():
    bad = [b for p in pages() for b in broken(p, generated=False)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_links_into_benchmarks_resolve():
    text = (ROOT / "BENCHMARKS.md").read_text()
    if not re.search(r"^#+ current numbers", text, re.IGNORECASE | re.MULTILINE):
        pytest.skip("BENCHMARKS.md has no current-numbers table yet, the anchor the pages link to")
    bad = [b for p in pages() for b in broken(p, generated=True)]
    assert not bad, "broken links into BENCHMARKS.md:\n" + "\n".join(bad)


def test_slugs_follow_github():
    assert slug("`--strategy dp` (legacy `nn.DataParallel`)") == "--strategy-dp-legacy-nndataparallel"
    assert slug("ZeRO-1, ZeRO-2, ZeRO-3 / FSDP") == "zero-1-zero-2-zero-3--fsdp"
    assert slug("Teardown: why a rank ends with `os._exit`") == "teardown-why-a-rank-ends-with-os_exit"
