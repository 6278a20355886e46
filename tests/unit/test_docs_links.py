"""Invariant: every relative link in README.md, docs/**/*.md and bench/README.md resolves.

A link ``](path)`` names a file that exists, and ``](path#anchor)`` (or ``](#anchor)``) a heading of
that page, as GitHub spells its anchors. Links inside code blocks and to other sites are not checked.
The sdist ships docs/ without docs/results/, so the check runs only in a full checkout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")

pytestmark = pytest.mark.skipif(not (ROOT / "docs" / "results").is_dir(), reason="not a full checkout")


def _lines(path: Path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    found, seen = set(), {}
    for _, line in _lines(path):
        match = HEADING.match(line)
        if match:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2)).lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(files: list[Path]) -> list[str]:
    problems = []
    for page in files:
        for number, line in _lines(page):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not dest.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{where}: no such heading")
    return problems


def test_every_relative_link_in_the_docs_resolves():
    files = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert broken_links(files) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# A page\n\n## Two words\n\n[ok](#two-words) [ok](a.md#a-page)\n"
                                   "[bad](#nope) [bad](b.md)\n```\n[in code](c.md)\n```\n")
    assert broken_links([tmp_path / "a.md"]) == ["a.md:6: #nope: no such heading", "a.md:6: b.md: no such file"]
