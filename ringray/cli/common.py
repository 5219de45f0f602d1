"""What every command shares: one stderr console, one-line errors, and the spec loader.

Errors are one line on stderr and exit code 2, never a traceback: :func:`fail`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:  # the spec imports torch: load it only when a command needs it
    from ringray.spec import JobSpec

err = Console(stderr=True, emoji=False, markup=False)
"""Progress, events and errors go to stderr; results (tables, JSON, ids) to stdout. What it
prints is text as given, never rich markup or emoji codes: a user's ``[/b]`` raised
MarkupError, and ``lognormal:100:2`` became ``lognormal💯2``. Style goes in a ``Text``."""


def fail(message: str) -> NoReturn:
    """End the command with ``error: <message>`` on one line and exit code 2."""
    err.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False,
              soft_wrap=True)
    raise typer.Exit(code=2)


def first_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (SDK errors put the cause there)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def read_spec(spec_path: str, overrides: list[str], *, steps: int | None = None,
              check_paths: bool = True) -> JobSpec:
    """The validated spec with ``--set`` and ``--steps`` applied; a bad one ends the command
    in one line."""
    from ringray.spec import JobSpecError, load_job_spec

    if steps is not None:
        overrides = [*overrides, f"train.steps={steps}"]
    try:
        return load_job_spec(spec_path, overrides, check_paths=check_paths)
    except JobSpecError as exc:
        fail(str(exc).replace("\n", "; "))


def load_spec(spec_path: str, overrides: list[str], *, steps: int | None,
              check_paths: bool = True) -> JobSpec:
    """:func:`read_spec`, checked as far as `ringray train` needs (an explicit mesh too)."""
    return _with_job_options(read_spec(spec_path, overrides, steps=steps,
                                       check_paths=check_paths))


def load_run(run: str, overrides: list[str], *, steps: int | None = None,
             check_paths: bool = True) -> JobSpec:
    """The spec of the run in directory ``run``, read from where the directory is now
    (:func:`ringray.spec.run_spec.load_run_spec`), with ``--set`` and ``--steps`` applied and
    checked as :func:`load_spec` does; a bad one ends the command in one line."""
    from ringray.spec import JobSpecError
    from ringray.spec.run_spec import load_run_spec

    if steps is not None:
        overrides = [*overrides, f"train.steps={steps}"]
    try:
        spec = load_run_spec(run, overrides, check_paths=check_paths)
    except JobSpecError as exc:
        fail(str(exc).replace("\n", "; "))
    return _with_job_options(spec)


def _with_job_options(spec: JobSpec) -> JobSpec:
    """``spec``, once its job options build (an explicit mesh too)."""
    from ringray.spec import JobSpecError

    try:
        spec.job_options()
    except JobSpecError as exc:
        fail(str(exc))
    return spec
