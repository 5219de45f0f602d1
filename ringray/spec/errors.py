"""How a job spec's problems are read and reported: a strict YAML loader and pydantic errors
rewritten as one line per problem that names the field, the bad value and what would be valid.

    data = load_yaml(text)                         # yaml.SafeLoader, stricter (see below)
    message = format_validation_error(exc, JobSpec)
    # train.steps: 'ten' is not an integer; e.g. 100

Used by :mod:`ringray.spec`; nothing here knows the spec's fields except through the
pydantic model it is given.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Hashable

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


class _StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no Python objects) that rejects a key given twice in one mapping,
    which plain YAML silently resolves to the last one, and reads ``1e-3`` as a float, as
    YAML 1.2 does (PyYAML's YAML 1.1 floats need a dot, so ``lr: 1e-3`` would be a string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                line = key_node.start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    problem=f"line {line}: key {key!r} appears twice in one mapping; keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictSafeLoader.add_implicit_resolver(  # copies the resolver table: SafeLoader is untouched
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> object:
    """Parse YAML safely (plain data only); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass


def describe_yaml_error(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: where (line, column) and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return " ".join(f"{where}{problem}".split())


def show_value(value: object) -> str:
    """A value as a job file would spell it (``null``, ``true``, ``'text'``), kept short."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = repr(value)
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def field_path(loc: tuple) -> str:
    """``('eval', 'passkey_depths', 1)`` -> ``eval.passkey_depths[1]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _unwrap(annotation: object) -> list[object]:
    """The non-None members of an annotation, without their ``Annotated`` markers
    (``Annotated[int, Ge(1)] | None`` -> ``[int]``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) if a is not type(None)
                for m in _unwrap(a)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return [annotation]


def _markers(info: FieldInfo) -> list[object]:
    """A field's constraint markers: pydantic's own, and those inside ``Annotated`` members of
    its annotation (``Annotated[int, Ge(0), Le(65535)] | None``)."""
    found = list(info.metadata)
    pending = [info.annotation]
    while pending:
        annotation = pending.pop()
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Annotated:
            found.extend(args[1:])
            pending.append(args[0])
        elif origin in (typing.Union, types.UnionType):
            pending.extend(args)
    return found


def _lookup(root: type[BaseModel], loc: tuple) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The section model at ``loc`` (if ``loc`` names a section) and the field ``loc`` names."""
    model: type[BaseModel] | None = root
    info: FieldInfo | None = None
    for part in loc:
        if isinstance(part, int) or model is None:
            model = None  # inside a list or mapping: no section below
            continue
        info = model.model_fields.get(part)
        if info is None:
            return None, None
        sections = [a for a in _unwrap(info.annotation)
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        model = sections[0] if sections else None
    return model, info


def _example(info: FieldInfo | None) -> str:
    """``; e.g. <default>`` when the field has a plain default worth showing."""
    if info is None or info.default_factory is not None:
        return ""
    default = info.default
    if default is None or isinstance(default, (BaseModel, dict, list)):
        return ""
    return f"; e.g. {show_value(default)}"


def _bound(ctx: dict, key: str, integer: bool) -> str:
    limit = ctx[key]
    what = "an integer" if integer else "a number"
    return {"gt": f"{what} > {limit}", "ge": f"{what} >= {limit}",
            "lt": f"{what} < {limit}", "le": f"{what} <= {limit}"}[key]


def _describe(error: dict, root: type[BaseModel]) -> str:
    """One problem, without its location: the bad value and what would be valid."""
    kind, ctx = error["type"], error.get("ctx", {})
    loc = tuple(error["loc"])
    shown = show_value(error.get("input"))
    section, info = _lookup(root, loc)
    integer = info is not None and int in _unwrap(info.annotation) or kind.startswith("int")
    if error.get("input", "") is None and kind.endswith("_type") and section is None:
        return f"null is not allowed here{_example(info)}"
    if kind == "extra_forbidden":
        parent, _ = _lookup(root, loc[:-1])
        valid = ", ".join(parent.model_fields) if parent else ""
        return f"unknown field; valid: {valid}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if section is not None:
            return (f"{shown} is not a section; give a mapping of its fields "
                    f"({', '.join(section.model_fields)}), or leave it out for the defaults")
        return f"{shown} is not a mapping; e.g. {{CPU: 1}}"
    if kind in ("int_type", "int_parsing"):
        return f"{shown} is not an integer{_example(info)}"
    if kind == "int_from_float":
        return f"{shown} is not a whole number; use an integer"
    if kind in ("float_type", "float_parsing"):
        return f"{shown} is not a number{_example(info)}"
    if kind == "finite_number":
        return f"{shown} is not a finite number"
    if kind in ("bool_type", "bool_parsing"):
        return f"{shown} is not a boolean; use true or false"
    if kind == "string_type":
        return f"{shown} is not a string; quote it if it should be one: '{error['input']}'"
    if kind == "list_type":
        return f"{shown} is not a list; e.g. [1024, 4096]"
    if kind == "literal_error":
        return f"{shown} is not one of {ctx['expected'].replace(' or ', ', ')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        key = {"greater_than": "gt", "greater_than_equal": "ge",
               "less_than": "lt", "less_than_equal": "le"}[kind]
        side = "small" if key in ("gt", "ge") else "large"
        valid = _bound(ctx, key, integer)
        if info is not None and section is None:  # both bounds, when the field has two
            bounds = [m for m in _markers(info) if hasattr(m, "le") or hasattr(m, "lt")
                      or hasattr(m, "ge") or hasattr(m, "gt")]
            low = next((b for b in bounds if getattr(b, "ge", None) is not None), None)
            high = next((b for b in bounds if getattr(b, "le", None) is not None), None)
            if low is not None and high is not None:
                valid = f"{'an integer' if integer else 'a number'} from {low.ge} to {high.le}"
        return f"{shown} is too {side}; use {valid}"
    if kind == "string_too_short":
        return f"{shown} is empty; give a value{_example(info)}"
    if kind == "missing":
        return "required; give a value"
    if kind == "value_error":  # our own validators: the message already names value and fix
        return error["msg"].removeprefix("Value error, ")
    return f"{shown}: {error['msg']}"


def format_validation_error(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: ``field.path: <value> is ...; <what would be valid>``.

    A validator may start its message with a field path of its own (``GPU: 0.5 ...`` from
    the ``cluster.worker_resources`` validator, ``train.seq_len: ...`` from the spec's); that
    path is taken as relative to where the validator sits.
    """
    lines = []
    for error in exc.errors():
        message = _describe(error, root)
        location = field_path(tuple(error["loc"]))
        own_path = error["type"] == "value_error" and re.match(r"^[\w.\[\]]+: ", message)
        if location:
            message = f"{location}{'.' if own_path else ': '}{message}"
        lines.append(message)
    return "\n".join(lines)
