"""docs/README.md is the map of the documentation: every page of docs/ is listed there once, under guide,
reference or measurements, and every link there points at a page that exists."""

from __future__ import annotations

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
SECTIONS = ("## Guide", "## Reference", "## Measurements")


def test_every_page_of_docs_is_listed_once_in_docs_readme():
    index = (DOCS / "README.md").read_text()
    assert [s for s in SECTIONS if s in index] == list(SECTIONS)
    linked = re.findall(r"^- \[([^\]]+)\]\(([^)]+)\): \S", index, flags=re.MULTILINE)
    targets = [t for _, t in linked]
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert sorted(targets) == pages, f"unlisted: {sorted(set(pages) - set(targets))}; gone: {sorted(set(targets) - set(pages))}"
    assert all(name == target for name, target in linked)
