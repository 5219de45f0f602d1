"""Spec sections derived from the components' own option dataclasses.

Each component declares its options once, as a frozen dataclass whose fields carry their type,
bounds (``annotated_types`` markers inside ``Annotated``), default and a docstring right under
the field::

    @dataclass(frozen=True, kw_only=True)
    class CheckpointOptions:
        keep: Annotated[int, Ge(1)] = 3
        \"\"\"Complete checkpoints kept (older ones of this run are deleted).\"\"\"

:func:`section_model` turns such a class into the strict pydantic model that validates its
YAML section (unknown fields are errors, no coercion of ``"10"`` or ``true``), with the
docstrings as field descriptions; :meth:`Section.options` turns a validated section back into
the dataclass. Nothing is declared twice: the section has exactly the dataclass's fields and
defaults, which ``tests/test_spec_sections.py`` checks for every section of the job spec.

Checks that look at a value's meaning rather than its type live in the dataclass's
``__post_init__`` (so Python callers get them too); a ``ValueError`` raised there names the
field, and the job spec prefixes the section's path.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, create_model


class Section(BaseModel):
    """A validated YAML section; :meth:`options` gives the component's dataclass."""

    # strict: YAML already gives typed values, so a quoted number or a yes/no where a number
    # belongs is a mistake to report, not to coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    __options_class__: typing.ClassVar[type | None] = None

    def options(self) -> typing.Any:
        """The component's options dataclass for this section (its ``__post_init__`` checks
        run here and may raise ``ValueError`` naming a field)."""
        cls = type(self).__options_class__
        assert cls is not None, "a Section made by section_model()"
        hints = _hints(cls)
        values = {}
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            values[field.name] = _to_option_value(getattr(self, field.name), hints[field.name])
        return cls(**values)


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of ``cls`` (a string literal right after an
    annotated assignment), by field name; base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # the class statement's body
        for node, following in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls, include_extras=True)


def _members(annotation: object) -> tuple[object, ...]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _spec_type(annotation: object) -> object:
    """The annotation a section field gets: nested option dataclasses become their sections,
    tuples become lists (YAML has no tuples) and mappings become dicts."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return typing.Annotated[(_spec_type(args[0]), *args[1:])]
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(lambda a, b: a | b, [_spec_type(a) for a in args])
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[_spec_type(args[0])]
    if origin in (dict, Mapping) or annotation is Mapping:
        key, value = args or (str, object)
        return dict[_spec_type(key), _spec_type(value)]
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return section_model(annotation)
    return annotation


def _spec_value(value: object) -> object:
    """A dataclass default as the section holds it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        model = section_model(type(value))
        return model(**{f.name: _spec_value(getattr(value, f.name))
                        for f in dataclasses.fields(value) if f.init})
    if isinstance(value, tuple):
        return [_spec_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _spec_value(v) for k, v in value.items()}
    return value


def _to_option_value(value: object, annotation: object) -> object:
    """A section's value as the dataclass field of type ``annotation`` holds it."""
    if isinstance(value, Section):
        return value.options()
    if isinstance(value, list):
        inner = next((typing.get_args(_strip(m)) for m in _members(_strip(annotation))
                      if typing.get_origin(_strip(m)) is tuple), None)
        element = inner[0] if inner else object
        converted = [_to_option_value(v, element) for v in value]
        return tuple(converted) if inner is not None else converted
    if isinstance(value, dict):
        return dict(value)
    return value


def _strip(annotation: object) -> object:
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


@functools.cache
def section_model(cls: type) -> type[Section]:
    """The strict pydantic model of the YAML section that ``cls`` (a frozen dataclass of
    options) describes: same fields, same defaults, its docstrings as descriptions.

    Raises:
        TypeError: if a field has no docstring (every option is documented where declared).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    hints, docs = _hints(cls), attribute_docs(cls)
    fields: dict[str, tuple[object, object]] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.name not in docs:
            raise TypeError(f"{cls.__qualname__}.{field.name} has no docstring; write one "
                            f"under the field (it becomes the job file reference's text)")
        if field.default is not dataclasses.MISSING:
            info = Field(_spec_value(field.default), description=docs[field.name])
        elif field.default_factory is not dataclasses.MISSING:
            factory = field.default_factory
            info = Field(default_factory=lambda factory=factory: _spec_value(factory()),
                         description=docs[field.name])
        else:
            info = Field(description=docs[field.name])
        fields[field.name] = (_spec_type(hints[field.name]), info)
    model = create_model(f"{cls.__name__}Section", __base__=Section,
                         __module__=cls.__module__, __doc__=cls.__doc__, **fields)
    model.__options_class__ = cls
    return model
