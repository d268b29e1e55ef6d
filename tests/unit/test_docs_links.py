"""Every relative link in README.md and docs/ names a file that exists and, with a #fragment, a
heading of that file (GitHub's anchors). Pure: reads the Markdown, follows nothing outside the tree."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link targets and emphasis dropped, lower case, punctuation
    other than '-' and '_' removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found.update(HTML_ANCHOR.findall(text))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for no, line in prose_lines(path.read_text()):
        line = CODE_SPAN.sub("", line)  # `[x](y)` in code is no link
        out += [(no, target) for target in INLINE_LINK.findall(line)]
        m = REFERENCE_DEF.match(line)
        if m:
            out.append((no, m.group(1)))
    return out


def broken(path: Path) -> list[str]:
    bad = []
    for no, target in links(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{no}: {target}"
        if not dest.exists():
            bad.append(f"{where}: no such file")
        elif fragment and dest.suffix == ".md" and unquote(fragment).lower() not in anchors(dest):
            bad.append(f"{where}: no heading #{fragment} in {dest.relative_to(REPO)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    assert broken(page) == []


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top `x` (y)\n\n## Top x y\n\n[ok](#top-x-y)\n[ok](b.md#one-two)\n"
                                   "[gone](c.md)\n[gone](b.md#three)\n[self](#nope)\n`[in code](d.md)`\n"
                                   "```\n[fenced](e.md)\n```\n[ok](#top-x-y-1)\n")
    (tmp_path / "b.md").write_text("### One, two!\n")
    assert broken(tmp_path / "a.md") == [
        "a.md:7: c.md: no such file",
        "a.md:8: b.md#three: no heading #three in b.md",
        "a.md:9: #nope: no heading #nope in a.md",
    ]
