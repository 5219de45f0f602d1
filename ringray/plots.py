"""``ringray report RUN``: PNG plots of a run's steps, for people who would rather look than read.

    paths = write_report("runs/quickstart")          # runs/quickstart/report/*.png
    paths = write_report("runs/quickstart", "plots")  # somewhere else

Reads the run directory's ``steps.jsonl`` (one :class:`ringray.train.step_stats.StepStats` per
line) and writes one plot per question (loss, tokens/s, overlap, load imbalance against the
step) and an overview with all four. Overlap and imbalance show the job's worst ring and,
when the job has several rings, each ring; beside the overlap, on its own axis in seconds,
the longest wait of any rank for a late ring peer (``peer_wait_seconds_max``), which the
overlap leaves out, and, for a job with Ulysses groups, the longest all-to-all of any rank
(the largest of ``a2a_seconds``). Where ``events.jsonl`` says the workers were
started at a step after 0 (a recovery or a resumed run restoring a checkpoint), a dashed line
marks that step.

Where the run directory holds passkey evaluations (``passkey.json``, written by the job after
training, and any ``passkey-<label>.json`` written beside it, e.g. the "before" evaluations of
``examples/context_extension.py``), ``passkey.png`` shows exact-match retrieval per needle depth,
one panel per context length and one line per evaluation, so before and after read side by side.

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


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_text(path: Path) -> str:
    """The file's text; :class:`ReportError` naming the byte when it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: not UTF-8 text (byte {exc.start}: "
                          f"{data[exc.start:exc.start + 1]!r})") from None


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message is one line naming the file."""


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's PNG plots into ``out_dir`` (default: ``<run_dir>/report``).

    Returns:
        The written files: ``loss.png``, ``tokens_per_second.png``, ``overlap.png``,
        ``load_imbalance.png`` and ``overview.png``, then ``passkey.png`` when the run
        directory holds passkey evaluations (:func:`read_passkey_reports`).

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
    passkey = read_passkey_reports(run_dir)
    if passkey:
        paths.append(_save(_passkey_figure(passkey, title), out / "passkey.png"))
    return paths


def read_steps(path: Path) -> list[dict]:
    """The step records of a ``steps.jsonl``, in file order.

    A last line without its newline is being written by a live run and is left out.

    Raises:
        ReportError: the file is missing, holds no step, or a line is not a step record.
    """
    if not path.is_file():
        raise ReportError(f"{path}: not found (is {path.parent} a run directory?)")
    text = _read_text(path)
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
        wrong = [key for key in _REQUIRED if not (
            _is_number(record[key]) or (key != "step" and record[key] is None))]
        if wrong or not isinstance(record["step"], int):
            key = wrong[0] if wrong else "step"
            raise ReportError(f"{path}:{number}: not a step record ({key} is "
                              f"{record[key]!r}, not a number)")
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


PASSKEY_AFTER_LABEL = "after training (this run)"
"""Legend label of the run's own ``passkey.json`` (its evaluation after training)."""


def read_passkey_reports(run_dir: Path) -> list[tuple[str, dict]]:
    """``(label, report)`` of each passkey evaluation in ``run_dir``: the
    ``passkey-<label>.json`` files by name, then the job's own ``passkey.json``. A report is
    :meth:`ringray.data.PasskeyReport.to_dict`'s JSON; its optional ``"label"`` names it
    (default: ``<label>`` from the file name, or :data:`PASSKEY_AFTER_LABEL`).

    Raises:
        ReportError: a file is not JSON or has no per-cell accuracies.
    """
    files = sorted(run_dir.glob("passkey-*.json"))
    if (run_dir / "passkey.json").is_file():
        files.append(run_dir / "passkey.json")
    reports = []
    for path in files:
        try:
            report = json.loads(_read_text(path))
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}: not JSON ({exc.msg})") from None
        cells = report.get("cells") if isinstance(report, dict) else None
        if not isinstance(cells, list) or not cells or not all(
            isinstance(c, dict) and {"length", "depth", "accuracy"} <= c.keys() for c in cells
        ):
            raise ReportError(f"{path}: not a passkey report (no cells with length, depth and "
                              f"accuracy)")
        for i, cell in enumerate(cells):
            if not (isinstance(cell["length"], int) and not isinstance(cell["length"], bool)
                    and cell["length"] > 0 and _is_number(cell["depth"])
                    and _is_number(cell["accuracy"])):
                raise ReportError(f"{path}: cell {i} is not a passkey cell (a positive integer "
                                  f"length, a number depth and accuracy): {cell!r}")
        if not isinstance(report.get("chance", {}), dict):
            raise ReportError(f"{path}: 'chance' is {report['chance']!r}, not an object of "
                              f"accuracies")
        default = (PASSKEY_AFTER_LABEL if path.name == "passkey.json"
                   else path.stem.removeprefix("passkey-"))
        reports.append((str(report.get("label") or default), report))
    return reports


def _passkey_figure(reports: list[tuple[str, dict]], title: str) -> Figure:
    """Exact match against needle depth: a panel per context length, a line per report."""
    lengths = sorted({c["length"] for _, report in reports for c in report["cells"]})
    fig = Figure(figsize=(max(6.0, 5.0 * len(lengths)), 4.5), layout="constrained")
    axes = fig.subplots(1, len(lengths), squeeze=False)[0]
    for ax, length in zip(axes, lengths, strict=True):
        for i, (label, report) in enumerate(reports):
            cells = sorted((c["depth"], c["accuracy"]) for c in report["cells"]
                           if c["length"] == length)
            if cells:
                ax.plot([d for d, _ in cells], [a for _, a in cells], label=label,
                        color=f"C{i}", marker="o", linewidth=1.6)
        chance = reports[-1][1].get("chance", {}).get("accuracy")
        if isinstance(chance, int | float):
            ax.axhline(chance, color="grey", linewidth=0.8, linestyle=":", label="chance")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlim(-0.03, 1.03)
        ax.set_title(f"passkey retrieval at {length} tokens")
        ax.set_xlabel("needle depth (0: start of the context, 1: end)")
        ax.set_ylabel("exact match")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(title, fontweight="bold")
    return fig


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
    a2a = any(s.get("a2a_seconds") for s in steps)  # a job with Ulysses groups
    _decorate(ax, "ring overlap: share of transfers hidden behind compute; peer wait"
              + ("; all-to-all" if a2a else ""), "overlap ratio (1: all hidden)", restarts)
    _plot_seconds(ax, steps, a2a=a2a)


def _plot_seconds(ax: Axes, steps: list[dict], *, a2a: bool) -> None:
    """Per step, on a second axis (seconds) over the overlap's and in one legend with it: the
    longest wait for a late peer, and, with ``a2a`` (the job swaps heads in Ulysses groups),
    the longest rank's all-to-all time. Runs written before these figures existed have no
    such axis."""
    lines = []
    if any("peer_wait_seconds_max" in s for s in steps):
        lines.append(([_number(s.get("peer_wait_seconds_max")) for s in steps],
                      "peer wait, longest rank (s)", "C3"))
    if a2a:
        lines.append(([max(s.get("a2a_seconds") or [math.nan]) for s in steps],
                      "Ulysses all-to-all, longest rank (s)", "C4"))
    if not lines:
        return
    seconds = ax.twinx()
    for y, label, color in lines:
        seconds.plot([s["step"] for s in steps], y, label=label, color=color, linewidth=1.2,
                     linestyle="--")
    seconds.set_ylim(bottom=0)
    seconds.set_ylabel("seconds per step" if a2a else "waiting for a late peer (s)")
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = seconds.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, loc="best", fontsize="small")


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
