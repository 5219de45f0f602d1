"""``ringray report RUN``: PNG plots of a run's steps, for people who would rather look than read.

    paths = write_report("runs/quickstart")          # runs/quickstart/report/*.png
    paths = write_report("runs/quickstart", "plots")  # somewhere else

Reads the run directory's ``steps.jsonl`` (one :class:`ringray.train.step_stats.StepStats` per
line) and writes one plot per question (loss, tokens/s, overlap, load imbalance against the
step) and an overview with all four. Overlap and imbalance show the job's worst ring and,
when the job has several rings, each ring. Where ``events.jsonl`` says the workers were
started at a step after 0 (a recovery or a resumed run restoring a checkpoint), a dashed line
marks that step.

Plots are drawn on :class:`matplotlib.figure.Figure` objects with the Agg renderer, without
pyplot and its process-wide state, so this works on machines without a display.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

# The controller's event when its workers are up: "started 4 workers (dp=1 × cp=4) at step 25,
# restored ..." (ringray/cluster/controller.py). After step 0 it means a checkpoint was restored.
_STARTED_AT_STEP = re.compile(r"^started \d+ workers .* at step (\d+)")
_REQUIRED = ("step", "loss", "tokens_per_second", "overlap_ratio", "load_imbalance")


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message is one line naming the file."""


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's PNG plots into ``out_dir`` (default: ``<run_dir>/report``).

    Returns:
        The written files: ``loss.png``, ``tokens_per_second.png``, ``overlap.png``,
        ``load_imbalance.png`` and ``overview.png``.

    Raises:
        ReportError: the run directory or its ``steps.jsonl`` is missing, empty or malformed.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    steps = read_steps(run_dir / "steps.jsonl")
    restarts = read_restart_steps(run_dir / "events.jsonl")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    title = run_dir.resolve().name
    paths = []
    for name, plot in PLOTS.items():
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        plot(fig.subplots(), steps, restarts)
        fig.suptitle(title, fontweight="bold")
        paths.append(_save(fig, out / f"{name}.png"))
    fig = Figure(figsize=(13, 8), layout="constrained")
    for ax, plot in zip(fig.subplots(2, 2).flat, PLOTS.values(), strict=True):
        plot(ax, steps, restarts)
    fig.suptitle(title, fontweight="bold")
    paths.append(_save(fig, out / "overview.png"))
    return paths


def read_steps(path: Path) -> list[dict]:
    """The step records of a ``steps.jsonl``, in file order.

    A last line without its newline is being written by a live run and is left out.

    Raises:
        ReportError: the file is missing, holds no step, or a line is not a step record.
    """
    if not path.is_file():
        raise ReportError(f"{path}: not found (is {path.parent} a run directory?)")
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines = lines[:-1]
    steps = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}:{number}: not JSON ({exc.msg})") from None
        missing = [key for key in _REQUIRED if not isinstance(record, dict) or key not in record]
        if missing:
            raise ReportError(f"{path}:{number}: not a step record (no {', '.join(missing)})")
        steps.append(record)
    if not steps:
        raise ReportError(f"{path}: no steps recorded")
    return steps


def read_restart_steps(path: Path) -> list[int]:
    """Steps at which the controller started workers from a checkpoint (none if no file)."""
    if not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            message = json.loads(line).get("message", "")
        except (json.JSONDecodeError, AttributeError):
            continue  # a torn line of a live run: events are a convenience here
        match = _STARTED_AT_STEP.match(message)
        if match and int(match.group(1)) > 0:
            found.append(int(match.group(1)))
    return found


# ---------------------------------------------------------------- the plots
def _plot_loss(ax: Axes, steps: list[dict], restarts: list[int]) -> None:
    _line(ax, steps, "loss", label="loss")
    _decorate(ax, "training loss", "cross-entropy (nats/token)", restarts)


def _plot_tokens(ax: Axes, steps: list[dict], restarts: list[int]) -> None:
    _line(ax, steps, "tokens_per_second", label="tokens/s")
    ax.set_ylim(bottom=0)
    _decorate(ax, "throughput", "tokens per second", restarts)


def _plot_overlap(ax: Axes, steps: list[dict], restarts: list[int]) -> None:
    _per_ring(ax, steps, "overlap_ratio_per_ring")
    _line(ax, steps, "overlap_ratio", label="job (worst rank)")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    _decorate(ax, "ring overlap: share of communication hidden behind compute",
              "overlap ratio (1: all hidden)", restarts)


def _plot_imbalance(ax: Axes, steps: list[dict], restarts: list[int]) -> None:
    _per_ring(ax, steps, "load_imbalance_per_ring")
    _line(ax, steps, "load_imbalance", label="job (worst ring)")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    _decorate(ax, "load imbalance: max / mean attention compute in a ring",
              "imbalance ratio (1: even)", restarts)


PLOTS: dict[str, Callable[[Axes, list[dict], list[int]], None]] = {
    "loss": _plot_loss,
    "tokens_per_second": _plot_tokens,
    "overlap": _plot_overlap,
    "load_imbalance": _plot_imbalance,
}


def _line(ax: Axes, steps: list[dict], key: str, *, label: str) -> None:
    values = [_number(s.get(key)) for s in steps]
    ax.plot([s["step"] for s in steps], values, label=label, color="C0", linewidth=1.6,
            marker="." if len(steps) <= 50 else None)


def _per_ring(ax: Axes, steps: list[dict], key: str) -> None:
    """One thin line per ring, when the job has more than one (one ring is the job line)."""
    rings = max((len(s.get(key) or ()) for s in steps), default=0)
    if rings < 2:
        return
    x = [s["step"] for s in steps]
    for ring in range(rings):
        y = [_number((s.get(key) or ())[ring] if ring < len(s.get(key) or ()) else None)
             for s in steps]
        ax.plot(x, y, label=f"ring {ring}", color=f"C{ring + 1}", linewidth=0.9, alpha=0.8,
                zorder=3)  # over the job's line, which one of the rings always equals


def _decorate(ax: Axes, title: str, ylabel: str, restarts: list[int]) -> None:
    for i, step in enumerate(restarts):
        ax.axvline(step, color="black", linestyle="--", linewidth=0.9,
                   label="restored a checkpoint" if i == 0 else None)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(loc="best", fontsize="small")


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path
