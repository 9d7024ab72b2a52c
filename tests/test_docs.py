"""The README is a map into docs/, and no document points outside the project."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    found = set()
    for line in path.read_text().splitlines():
        match = re.match(r"^#+\s+(.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def test_readme_is_a_short_map_starting_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    quickstart = text.split("## Quickstart", 1)[1]
    block = re.search(r"```sh\n(.*?)```", quickstart, re.S).group(1)
    assert block.split("\n")[:-1] == ["make demo", "make test"]
    for page in ("pdd", "architecture", "operations", "latency", "billing", "metrics"):
        assert f"(docs/{page}.md" in text, page
    assert "(routing/gateway/README.md)" in text


def test_every_document_is_one_hop_from_the_readme():
    """A newcomer reaches every page of docs/ and every package's own README from the README's
    map in one hop."""
    text = (ROOT / "README.md").read_text()
    pages = [*sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/**/README.md"))]
    pages = [
        p
        for p in pages
        if not any(
            part.startswith(".") or part in {"var", "build", "node_modules"}
            for part in p.relative_to(ROOT).parts
        )
    ]
    unlinked = [
        str(p.relative_to(ROOT)) for p in pages if f"({p.relative_to(ROOT).as_posix()}" not in text
    ]
    assert not unlinked, f"not linked from README.md: {unlinked}"


def test_every_link_in_the_docs_resolves_inside_the_project():
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            full = (doc.parent / path).resolve() if path else doc
            assert full.is_relative_to(ROOT), f"{doc.name}: {target} leaves the project"
            assert full.exists(), f"{doc.name}: {target} does not exist"
            if anchor and full.suffix == ".md":
                assert anchor in _anchors(full), f"{doc.name}: no heading for {target}"


def test_no_tracked_file_points_at_files_outside_the_project():
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    outside = re.compile(r"\.\./shared|(?<![\w/])(PDD|ARCHITECTURE)\.md")
    hits = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or os.path.getsize(path) > 2_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}: {m.group(0)}" for m in outside.finditer(text)]
    assert not hits, hits[:10]


def test_the_readme_folder_table_matches_the_tree():
    """The README's folder table names every tracked top-level folder, and only those."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    tree = {name.split("/", 1)[0] for name in files if "/" in name and not name.startswith(".")}
    table = set(re.findall(r"^\| `([\w.-]+)/` \|", (ROOT / "README.md").read_text(), re.M))
    assert table == tree, f"missing from the README: {tree - table}; gone: {table - tree}"
