"""The CLI reference, generated from the typer app, and the command that writes the generated
blocks (this one and the job file reference) into their pages under ``docs/``.

    python -m ringray.cli.reference --write    # regenerate docs/job-file.md and docs/cli.md
    python -m ringray.cli.reference --check    # exit 1 if either page's block is stale

:func:`cli_reference` walks the app (every command and sub-command, its one-line help, its
examples and its options). Each block has one page (:data:`PAGES`), between
``<!-- BEGIN name -->`` and ``<!-- END name -->``; the prose around it is kept.
``tests/test_docs_reference.py`` runs ``--check`` on the repository's pages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ringray.spec.reference import (
    JOB_SPEC_MARKER,
    _cell,
    job_spec_reference,
    read_block,
    replace_block,
)

CLI_MARKER = "cli-reference"
PAGES = {JOB_SPEC_MARKER: Path("docs/job-file.md"), CLI_MARKER: Path("docs/cli.md")}
"""Where each generated block lives, relative to the repository."""


def _option_row(param: object, ctx: object) -> str:
    """One row, as ``ringray COMMAND --help`` shows the parameter (name, type, help with its
    default, range, environment variable)."""
    record = param.get_help_record(ctx)
    name, helptext = record if record else (param.name, "")
    return f"| `{_cell(name, code=True)}` | {_cell(helptext)} |"


def _is_group(command: object) -> bool:
    return hasattr(command, "commands")


def _commands(group: object, path: str) -> list[tuple[str, object]]:
    out = []
    for name in sorted(group.commands):
        command = group.commands[name]
        if command.hidden:
            continue
        out.append((f"{path} {name}", command))
        if _is_group(command):
            out.extend(_commands(command, f"{path} {name}"))
    return out


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def _examples(text: str) -> list[str]:
    """Command lines from ``Example: ringray ...`` lines and from an ``Examples:`` block (the
    ``ringray ...`` lines that follow it)."""
    found, in_block = [], False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Example:"):
            found.append(line.removeprefix("Example:").strip())
        elif line.startswith("Examples:"):
            in_block = True
        elif in_block and line.startswith("ringray "):
            found.append(line)
        elif in_block and line:
            in_block = False
    return found


def cli_reference(app: object | None = None) -> str:
    """Markdown: every command and sub-command of ``ringray`` with its help and options."""
    import typer

    if app is None:
        from ringray.cli import app
    root = typer.main.get_command(app)
    lines = [
        "Every `ringray` command, generated from the typer app (`ringray.cli.app`) by "
        "`python -m ringray.cli.reference --write`; `ringray COMMAND --help` "
        "prints the same.",
    ]
    for path, command in _commands(root, "ringray"):
        # typer vendors its own click, so parameters are told apart by their kind's name
        params = [p for p in command.params if p.name != "help"]
        arguments = " ".join(p.display_name_raw for p in params
                             if p.param_type_name == "argument")
        usage = f"{path} {arguments}".rstrip()
        if _is_group(command):
            usage += " COMMAND"
        elif any(p.param_type_name == "option" for p in params):
            usage += " [OPTIONS]"
        lines += ["", f"## `{usage}`", "", _first_paragraph(command.help or "")]
        examples = _examples(command.help or "")
        if examples:
            lines += ["", "Example" + ("s" if len(examples) > 1 else "") + ": "
                      + ", ".join(f"`{e}`" for e in examples)]
        if params and not _is_group(command):
            ctx = typer.Context(command, info_name=path)
            lines += ["", "| parameter | description |", "|---|---|"]
            lines += [_option_row(p, ctx) for p in params]
    return "\n".join(lines) + "\n"


def generated_blocks() -> dict[str, str]:
    return {JOB_SPEC_MARKER: job_spec_reference(), CLI_MARKER: cli_reference()}


def sync_pages(root: Path, *, write: bool) -> list[str]:
    """Compare (``write``: rewrite) each page's generated block with what the code generates
    now. Returns one line per page that is stale (after ``write``: none) or has no markers."""
    problems = []
    for name, body in generated_blocks().items():
        path = root / PAGES[name]
        text = path.read_text() if path.is_file() else ""
        if read_block(text, name) is None:
            problems.append(f"{path}: no <!-- BEGIN {name} --> ... <!-- END {name} --> block")
            continue
        updated = replace_block(text, name, body)
        if updated == text:
            continue
        if write:
            path.write_text(updated)
        else:
            problems.append(f"{path}: {name} is stale")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="Rewrite the pages' blocks.")
    action.add_argument("--check", action="store_true", help="Exit 1 if a block is stale.")
    action.add_argument("--print", choices=[JOB_SPEC_MARKER, CLI_MARKER],
                        help="Print one block.")
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="The repository whose docs/ holds the pages (default: here).")
    args = parser.parse_args(argv)
    if args.print:
        sys.stdout.write(generated_blocks()[args.print])
        return 0
    problems = sync_pages(args.root, write=args.write)
    for line in problems:
        print(line, file=sys.stderr)
    if problems and args.check:
        print("run python -m ringray.cli.reference --write", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
