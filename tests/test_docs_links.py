"""The documentation holds together: every relative link in README.md and docs/ reaches a file
of the project (and, with ``#anchor``, a heading of that file), the README links every page
under docs/, and nothing in the project cites a file outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Written apart so that this file does not cite them itself.
OUTSIDE = ("../" + "shared", "ARCHITECTURE" + ".md")
SCANNED = ("README.md", "Makefile", "pyproject.toml", "docs", "ringray", "tests", "jobs",
           "examples", "benchmarks", "infra", "dashboards")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".txt", ".cfg", ""}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (letters, digits,
    spaces, ``-`` and ``_`` kept), each space a ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(github_anchor(line.lstrip("#")))
    return found


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # not inside code
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT) or not file.exists():
            broken.append(f"{target}: no such file in the project")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {file.name} has no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link docs/{', docs/'.join(missing)}"


def test_anchor_rule() -> None:
    """The slug rule on the kinds of headings these pages use."""
    assert github_anchor("The GPU check: `make gpu-check`") == "the-gpu-check-make-gpu-check"
    assert github_anchor("Ulysses × ring (two-dimensional context parallelism)") == \
        "ulysses--ring-two-dimensional-context-parallelism"
    assert github_anchor("Recovery, measured") == "recovery-measured"


def test_nothing_cites_a_file_outside_the_project() -> None:
    files = []
    for name in SCANNED:
        path = ROOT / name
        files += [path] if path.is_file() else [
            f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
            and "__pycache__" not in f.parts]
    assert len(files) > 100, "the scan found too few files to mean anything"
    cited = [f"{f.relative_to(ROOT)}: {needle}" for f in files
             for needle in OUTSIDE if needle in f.read_text(errors="replace")]
    assert not cited, cited
