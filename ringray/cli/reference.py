"""The README's CLI reference, generated from the typer app, and the command that writes the
generated blocks (this one and the job file reference) into the README.

    python -m ringray.cli.reference --write README.md    # regenerate both sections
    python -m ringray.cli.reference --check README.md    # exit 1 if either is stale

:func:`cli_reference` walks the app (every command and sub-command, its one-line help, its
examples and its options); ``tests/test_docs_reference.py`` checks that the README holds
exactly what it and :func:`ringray.spec.reference.job_spec_reference` return.
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
        "`python -m ringray.cli.reference --write README.md`; `ringray COMMAND --help` "
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
        lines += ["", f"#### `{usage}`", "", _first_paragraph(command.help or "")]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="README", help="Rewrite the blocks in this file.")
    action.add_argument("--check", metavar="README", help="Exit 1 if a block is stale.")
    action.add_argument("--print", choices=[JOB_SPEC_MARKER, CLI_MARKER],
                        help="Print one block.")
    args = parser.parse_args(argv)
    if args.print:
        sys.stdout.write(generated_blocks()[args.print])
        return 0
    path = Path(args.write or args.check)
    text = path.read_text()
    updated = text
    for name, body in generated_blocks().items():
        updated = replace_block(updated, name, body)
    if args.check:
        stale = [n for n in generated_blocks() if read_block(text, n) != read_block(updated, n)]
        if stale:
            print(f"{path}: stale: {', '.join(stale)}; run python -m ringray.cli.reference "
                  f"--write {path}", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        path.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
