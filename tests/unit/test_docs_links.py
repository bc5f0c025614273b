"""README.md stays short, links only into the repository, and every file it links exists;
the docs link nothing outside the repository by a relative path (the strict site build
checks the links between pages)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_readme_links_resolve_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    links = LINK.findall(text)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path = (ROOT / link.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"README.md links outside the repository: {link}"
        assert path.exists(), f"README.md links a missing file: {link}"


def test_docs_link_nothing_outside_docs():
    for page in (ROOT / "docs").rglob("*.md"):
        for link in LINK.findall(page.read_text()):
            if link.startswith(("http://", "https://", "#")):
                continue
            path = (page.parent / link.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT / "docs"), f"{page}: links outside docs/: {link}"


def test_every_committed_bench_run_has_a_page():
    pages = "".join(p.read_text() for p in (ROOT / "docs" / "benchmarks").glob("*.md"))
    runs = [d.name for d in (ROOT / "docs" / "bench").iterdir() if d.is_dir()]
    assert runs
    unlinked = [run for run in runs if f"../bench/{run}/" not in pages]
    assert not unlinked, f"docs/bench/ runs no Benchmarks page links: {unlinked}"
