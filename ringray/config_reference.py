"""The README's job file and CLI references, generated from the code so they cannot drift.

    python -m ringray.config_reference --write README.md    # regenerate both sections
    python -m ringray.config_reference --check README.md    # exit 1 if either is stale

:func:`job_spec_reference` walks the pydantic :class:`~ringray.config.JobSpec` (one table per
section: field, type, default, description); :func:`cli_reference` walks the typer app
(``ringray.cli.app``: every command and sub-command, its one-line help and its options). Each
goes between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` markers in the README;
``tests/test_docs_reference.py`` checks that the README holds exactly what they return.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

JOB_SPEC_MARKER = "job-spec-reference"
CLI_MARKER = "cli-reference"


def _cell(text: str, *, code: bool = False) -> str:
    """Text safe inside a markdown table cell (and, unless it is in a code span, with
    ``<name>`` shown rather than taken for an HTML tag)."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if code else text.replace("<", "&lt;")


def _bounds(metadata: list[object]) -> str:
    # Field(ge=...) inside Annotated (list items) arrives as a FieldInfo holding the bounds
    metadata = [m for item in metadata
                for m in (item.metadata if isinstance(item, FieldInfo) else [item])]
    symbols = [(annotated_types.Ge, "ge", "≥"), (annotated_types.Gt, "gt", ">"),
               (annotated_types.Le, "le", "≤"), (annotated_types.Lt, "lt", "<")]
    parts = [f"{sign} {getattr(m, attr)}" for m in metadata
             for kind, attr, sign in symbols if isinstance(m, kind)]
    return f" ({', '.join(parts)})" if parts else ""


def _type_name(annotation: object, metadata: list[object] | None = None) -> str:
    """``int | None`` -> ``int or null``; ``list[Annotated[float, ge=0]]`` -> ``list of float
    (≥ 0)``; a ``Literal`` lists its values; a section is named ``section``."""
    metadata = metadata or []
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0], [*metadata, *args[1:]])
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        names = " or ".join(_type_name(a) for a in members)
        return f"{names}{_bounds(metadata)} or null" if type(None) in args else names
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    name = getattr(annotation, "__name__", str(annotation))
    return f"{name}{_bounds(metadata)}"


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{value}`"


def _section_table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        lines.append(
            f"| `{prefix}{name}` | {_cell(_type_name(info.annotation, info.metadata))} | "
            f"{_cell(_default(info))} | {_cell(info.description or '')} |"
        )
    return lines


def _sections(model: type[BaseModel], prefix: str) -> list[tuple[str, type[BaseModel]]]:
    """``(dotted prefix, section model)`` for every section below ``model``, depth first."""
    out = []
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out.append((f"{prefix}{name}", info.annotation))
            out.extend(_sections(info.annotation, f"{prefix}{name}."))
    return out


def job_spec_reference() -> str:
    """Markdown: the top-level fields, then one table per section of the job spec."""
    from ringray.config import JobSpec

    top = {name: info for name, info in JobSpec.model_fields.items()
           if not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel))}
    lines = [
        "Every field of a job file (`jobs/*.yaml`), generated from `ringray.config.JobSpec` by "
        "`python -m ringray.config_reference --write README.md`. Unknown fields and values "
        "of the wrong type are errors; `--set section.field=value` overrides any of them.",
        "",
        "**Top level**",
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    for name, info in top.items():
        lines.append(f"| `{name}` | {_cell(_type_name(info.annotation, info.metadata))} | "
                     f"{_cell(_default(info))} | {_cell(info.description or '')} |")
    for dotted, section in _sections(JobSpec, ""):
        description = JobSpec.model_fields[dotted.split(".")[0]].description
        if "." in dotted:
            parent, leaf = dotted.rsplit(".", 1)
            description = dict(_sections(JobSpec, ""))[parent].model_fields[leaf].description
        lines += ["", f"**`{dotted}`**: {description}", ""]
        lines += _section_table(section, f"{dotted}.")
    return "\n".join(lines) + "\n"


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
        "`python -m ringray.config_reference --write README.md`; `ringray COMMAND --help` "
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


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN {name} -->\n)(.*?)(<!-- END {name} -->)", re.DOTALL)


def read_block(text: str, name: str) -> str | None:
    """The text between a README's markers for ``name`` (``None`` if they are missing)."""
    match = _block(name).search(text)
    return match.group(2) if match else None


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block for ``name`` replaced by ``body``; raises if it has none."""
    if read_block(text, name) is None:
        raise ValueError(f"no <!-- BEGIN {name} --> ... <!-- END {name} --> markers")
    return _block(name).sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


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
            print(f"{path}: stale: {', '.join(stale)}; run python -m ringray.config_reference "
                  f"--write {path}", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        path.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
