"""The `ringray plan` outputs quoted in README.md and docs/ are what the command prints now.

A quoted block is a ```text block that starts with the command (``$ ringray plan ...``, a
trailing backslash continuing it) or with the report's first line (``job 'NAME' on CLUSTER:``,
whose command is ``ringray plan jobs/NAME.yaml --cluster CLUSTER``). Every other line of the
block, ``...`` aside (lines left out), must appear in the output, in the block's order."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringray.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIRST_LINE = re.compile(r"job '(?P<name>[^']+)' on (?P<cluster>\S+):")


def _text_blocks(page: Path) -> list[tuple[int, list[str]]]:
    """(line number, lines) of each ```text block."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if current is None and line.strip() == "```text":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _quoted_plans() -> list[tuple[str, list[str], list[str]]]:
    """(where, the command's arguments after ``ringray``, the quoted output lines)."""
    quoted = []
    for page in PAGES:
        for start, lines in _text_blocks(page):
            where = f"{page.relative_to(ROOT)}:{start}"
            if lines and lines[0].startswith("$ ringray plan "):
                command, rest = lines[0][2:], lines[1:]
                while command.endswith("\\") and rest:
                    command, rest = command[:-1] + rest[0].strip(), rest[1:]
                quoted.append((where, shlex.split(command)[1:], rest))
            elif lines and (first := FIRST_LINE.match(lines[0])):
                args = ["plan", f"jobs/{first['name']}.yaml", "--cluster", first["cluster"]]
                quoted.append((where, args, lines))
    return quoted


QUOTED = _quoted_plans()


def test_the_docs_quote_plans() -> None:
    """The scan finds the quotes it is meant to keep current (README's and planning.md's)."""
    pages = {where.split(":")[0] for where, _, _ in QUOTED}
    assert {"README.md", "docs/planning.md"} <= pages, QUOTED


@pytest.mark.parametrize(("where", "args", "lines"), QUOTED, ids=[q[0] for q in QUOTED])
def test_a_quoted_plan_is_what_the_command_prints(
        where: str, args: list[str], lines: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    printed = [line.rstrip() for line in result.stdout.splitlines()]
    position = 0
    for line in lines:
        if line.strip() in ("", "..."):
            continue
        try:
            position = printed.index(line.rstrip(), position) + 1
        except ValueError:
            near = [p for p in printed if p.split()[:2] == line.split()[:2]]
            raise AssertionError(f"{where}: the quoted line {line.strip()!r} is not in the "
                                 f"output of `ringray {shlex.join(args)}` (in order); the "
                                 f"output has {near or 'no line like it'}") from None
