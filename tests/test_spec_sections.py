"""Each option is declared once: every section of the job spec holds exactly the fields of the
component dataclass it feeds, with the same defaults, so a default can never drift between
the YAML and the code that reads it. The drift check itself is shown to fail on a section
written by hand that disagrees."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated

import pytest
from annotated_types import Ge
from pydantic import BaseModel, Field

from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.data import DataOptions
from ringray.metrics import MetricsOptions
from ringray.model import ModelOptions, RopeOptions
from ringray.spec import JobSpec, JobSpecError, parse_job_spec
from ringray.spec.sections import Section, attribute_docs, section_model
from ringray.train import (
    CheckpointOptions,
    EvalOptions,
    OptimizerOptions,
    ParallelOptions,
    TrainingOptions,
    TrainOptions,
)

SECTIONS = {
    "model": ModelOptions,
    "model.rope": RopeOptions,
    "data": DataOptions,
    "parallel": ParallelOptions,
    "train": TrainingOptions,
    "train.optimizer": OptimizerOptions,
    "checkpoint": CheckpointOptions,
    "eval": EvalOptions,
    "cluster": ClusterOptions,
    "metrics": MetricsOptions,
}


def _as_spec_value(value: object) -> object:
    """A dataclass value as YAML would spell it (tuples are lists, dataclasses mappings)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _as_spec_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_as_spec_value(v) for v in value]
    if isinstance(value, typing.Mapping):
        return {k: _as_spec_value(v) for k, v in value.items()}
    return value


def section_drift(section: type[BaseModel], options: type) -> list[str]:
    """Every way ``section`` disagrees with the dataclass ``options``: a field on one side
    only, or a different default."""
    problems = []
    spec_fields = list(section.model_fields)
    option_fields = [f.name for f in dataclasses.fields(options) if f.init]
    for name in spec_fields:
        if name not in option_fields:
            problems.append(f"{name}: in the section, not in {options.__name__}")
    for name in option_fields:
        if name not in spec_fields:
            problems.append(f"{name}: in {options.__name__}, not in the section")
    defaults = options() if all(
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        for f in dataclasses.fields(options) if f.init) else None
    for name in set(spec_fields) & set(option_fields):
        info = section.model_fields[name]
        spec_default = info.get_default(call_default_factory=True)
        if isinstance(spec_default, BaseModel):
            spec_default = spec_default.model_dump()
        want = _as_spec_value(getattr(defaults, name)) if defaults is not None else None
        if spec_default != want:
            problems.append(f"{name}: default {spec_default!r} in the section, {want!r} in "
                            f"{options.__name__}")
    return problems


def _section_at(path: str) -> type[BaseModel]:
    model: type[BaseModel] = JobSpec
    for part in path.split("."):
        model = model.model_fields[part].annotation
    return model


@pytest.mark.parametrize("path", list(SECTIONS))
def test_each_section_holds_its_components_fields_and_defaults(path: str) -> None:
    section = _section_at(path)
    assert issubclass(section, Section)
    assert section.__options_class__ is SECTIONS[path]
    assert section_drift(section, SECTIONS[path]) == []
    # The section's own defaults build the component's defaults, field for field.
    assert section().options() == SECTIONS[path]()


def test_every_section_of_the_job_spec_is_covered() -> None:
    """A new section must be added to SECTIONS above (so it is checked too)."""
    found = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                found.append(prefix + name)
                walk(info.annotation, f"{prefix}{name}.")

    walk(JobSpec, "")
    assert sorted(found) == sorted(SECTIONS)


def test_the_drift_check_catches_a_section_written_by_hand() -> None:
    """A copy of CheckpointOptions' section with one default changed, one field renamed and
    one missing is reported on each count: the check above can fail."""

    class HandWritten(BaseModel):
        path: str | None = Field(None, description="...")
        interval: int = Field(10, description="...")  # CheckpointOptions says 0
        keep_last: int = Field(3, description="...")  # CheckpointOptions calls it keep
        # resume: missing

    problems = section_drift(HandWritten, CheckpointOptions)
    assert "interval: default 10 in the section, 0 in CheckpointOptions" in problems
    assert "keep_last: in the section, not in CheckpointOptions" in problems
    assert "keep: in CheckpointOptions, not in the section" in problems
    assert "resume: in CheckpointOptions, not in the section" in problems


def test_the_spec_builds_exactly_the_components_defaults() -> None:
    """An empty job file is every component's defaults; nothing is copied by hand between
    them (the trainer, the controller and the spec read the same objects)."""
    spec = parse_job_spec({"parallel": {"cp": 2}})
    train = spec.train_options()
    assert train == TrainOptions(model=ModelOptions().build(), parallel=ParallelOptions(cp=2),
                                 run_dir="runs/ringray-job")
    job = spec.job_options()
    assert job == JobOptions(name="ringray-job", train=train)
    assert (job.cluster, job.metrics) == (ClusterOptions(), MetricsOptions())


def test_every_option_is_documented_where_it_is_declared() -> None:
    """The description in the job file reference is the docstring under the field."""
    for options in SECTIONS.values():
        docs = attribute_docs(options)
        undocumented = [f.name for f in dataclasses.fields(options) if f.name not in docs]
        assert undocumented == [], options.__name__
    assert section_model(OptimizerOptions).model_fields["lr"].description == \
        "Peak learning rate (AdamW)."


def test_an_undocumented_option_cannot_become_a_section() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Undocumented:
        steps: int = 1

    with pytest.raises(TypeError, match="Undocumented.steps has no docstring"):
        section_model(Undocumented)


@dataclass(frozen=True, kw_only=True)
class _Inner:
    sizes: tuple[Annotated[int, Ge(1)], ...] = (1, 2)
    """Sizes."""


@dataclass(frozen=True, kw_only=True)
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    """A nested section."""
    limits: typing.Mapping[str, float] | None = None
    """Per-name limits."""

    def __post_init__(self) -> None:
        if self.limits is not None and "x" in self.limits:
            raise ValueError("limits.x: not allowed")


def test_a_section_round_trips_nested_tuples_and_mappings() -> None:
    """YAML lists become the dataclass's tuples, nested sections its nested dataclasses,
    bounds inside tuples are enforced, and ``__post_init__`` checks run on the way back."""
    model = section_model(_Outer)
    section = model.model_validate({"inner": {"sizes": [3, 4]}, "limits": {"y": 1.0}})
    assert section.options() == _Outer(inner=_Inner(sizes=(3, 4)), limits={"y": 1.0})
    assert model().options() == _Outer()
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        model.model_validate({"inner": {"sizes": [0]}})
    with pytest.raises(ValueError, match="limits.x: not allowed"):
        model.model_validate({"limits": {"x": 1.0}}).options()


def test_a_check_in_a_component_reaches_the_spec_with_its_section_path() -> None:
    """EvalOptions refuses repeated lengths itself; the spec reports it under ``eval.``."""
    with pytest.raises(ValueError, match="passkey_lengths: .* repeats"):
        EvalOptions(passkey_lengths=(1024, 1024))
    with pytest.raises(JobSpecError, match=r"^eval\.passkey_lengths: \[1024, 1024\] repeats"):
        parse_job_spec({"eval": {"passkey_lengths": [1024, 1024]}})
