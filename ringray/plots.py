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

Where the run directory holds an lm-evaluation-harness evaluation (``eval/results.json``, written
by ``ringray eval RUN`` or by the job after training; :func:`read_task_results`), ``tasks.png``
shows each task's score against the context length, one panel per task, each point with the
samples it scored. An evaluation still running has cells missing; they are left out. Where
the job also evaluated its interval checkpoints (``eval.tasks_at_checkpoints``: an
``eval/step_<step>/results.json`` per checkpoint; :func:`read_task_results_by_step`),
``tasks_by_step.png`` shows each task's score against the training step, in the same panels, one
line per context length, through the final evaluation at the run's last step.

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
from matplotlib.ticker import MaxNLocator

from ringray.harness.evaluate import RESULTS
from ringray.train.run_dir import TASK_EVALUATION

# The controller's event when its workers are up: "started 4 workers (dp=1 × cp=4) at step 25,
# restored ..." (ringray/cluster/controller.py). After step 0 it means a checkpoint was restored.
_STARTED_AT_STEP = re.compile(r"^started \d+ workers .* at step (\d+)")
_REQUIRED = ("step", "loss", "tokens_per_second", "overlap_ratio", "load_imbalance")
# Where an lm-evaluation-harness evaluation of the run lands: ``ringray eval RUN``'s default
# --out (ringray/cli/evaluate.py), and the job's own after training.
TASK_RESULTS = Path(TASK_EVALUATION) / RESULTS
# The job's evaluations at its interval checkpoints, eval/step_<8-digit step>/results.json
# (ringray.train.run_dir.RunDirectory.record_task_evaluation); each says its step in model.step.
_STEP_TASK_RESULTS = f"{TASK_EVALUATION}/step_*/{RESULTS}"
_TASK_RESULTS_KEYS = ("tasks", "lengths", "cells")
_TASK_CELL_KEYS = ("task", "length", "score", "samples")


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
        directory holds passkey evaluations (:func:`read_passkey_reports`), then
        ``tasks.png`` when it holds an lm-evaluation-harness evaluation
        (:func:`read_task_results`), then ``tasks_by_step.png`` when it holds evaluations
        at interval checkpoints (:func:`read_task_results_by_step`).

    Raises:
        ReportError: the run directory or its ``steps.jsonl`` is missing, empty or malformed,
            or a passkey evaluation or a task evaluation (``eval/results.json``,
            ``eval/step_<step>/results.json``) is malformed or, beside evaluations at
            checkpoints, has no ``model.step``.
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
    tasks = read_task_results(run_dir)
    if tasks is not None:
        paths.append(_save(_tasks_figure(tasks, title), out / "tasks.png"))
    by_step = read_task_results_by_step(run_dir)
    if by_step:
        paths.append(_save(_tasks_by_step_figure(by_step, title), out / "tasks_by_step.png"))
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


def read_task_results(run_dir: str | Path) -> dict | None:
    """The run's lm-evaluation-harness results (``<run_dir>/eval/results.json``;
    :func:`read_task_results_file`), or None when there are none.

    Raises:
        ReportError: the file is malformed (:func:`read_task_results_file`).
    """
    path = Path(run_dir) / TASK_RESULTS
    return read_task_results_file(path) if path.is_file() else None


def read_task_results_by_step(run_dir: str | Path) -> list[tuple[int, dict]]:
    """``(step, results)`` of the job's evaluations at its interval checkpoints
    (``<run_dir>/eval/step_<step>/results.json``) and of its final one
    (``<run_dir>/eval/results.json``) when there is one, in step order, each step its
    ``model.step``; ``[]`` when no checkpoint's evaluation has written its results (a
    ``step_*`` directory without ``results.json`` is one still running).

    A step evaluated twice (a checkpoint at the last step) is the final evaluation's.

    Raises:
        ReportError: a file is malformed (:func:`read_task_results_file`), or has no
            ``model.step``.
    """
    run_dir = Path(run_dir)
    paths = [path for path in sorted(run_dir.glob(_STEP_TASK_RESULTS)) if path.is_file()]
    if not paths:
        return []
    if (run_dir / TASK_RESULTS).is_file():
        paths.append(run_dir / TASK_RESULTS)
    by_step = {}
    for path in paths:  # the final one last, so it wins a step evaluated twice
        results = read_task_results_file(path)
        by_step[_model_step(path, results)] = results
    return [(step, by_step[step]) for step in sorted(by_step)]


def _model_step(path: Path, results: dict) -> int:
    """The training step of the checkpoint that ``results`` evaluated (its ``model.step``)."""
    model = results.get("model")
    if not isinstance(model, dict) or "step" not in model:
        raise ReportError(f"{path}: no model.step (the training step of the checkpoint "
                          f"evaluated), so it cannot be plotted by step")
    step = model["step"]
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise ReportError(f"{path}: model.step is {step!r}, not a training step (an integer "
                          f">= 0)")
    return step


def read_task_results_file(path: str | Path) -> dict:
    """The lm-evaluation-harness results in ``path`` (a ``results.json`` as
    :func:`ringray.harness.evaluate.evaluate_plan` writes it).

    Cells may be missing for some (task, length): the evaluation is still running, or it
    skipped them.

    Raises:
        ReportError: the file is not JSON, has no ``tasks``, ``lengths`` or ``cells``, or a
            cell has no ``task``, ``length``, ``score`` or ``samples`` or one of the wrong kind.
    """
    path = Path(path)
    try:
        results = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON ({exc.msg})") from None
    missing = [k for k in _TASK_RESULTS_KEYS if not isinstance(results, dict) or k not in results]
    if missing:
        raise ReportError(f"{path}: not an lm_eval results file (no {', '.join(missing)})")
    if not (isinstance(results["tasks"], list)
            and all(isinstance(t, str) for t in results["tasks"])):
        raise ReportError(f"{path}: tasks is {results['tasks']!r}, not a list of task names")
    if not (isinstance(results["lengths"], list)
            and all(_is_length(n) for n in results["lengths"])):
        raise ReportError(f"{path}: lengths is {results['lengths']!r}, not a list of positive "
                          f"integers")
    if not isinstance(results["cells"], list):
        raise ReportError(f"{path}: cells is {results['cells']!r}, not a list of cells")
    for i, cell in enumerate(results["cells"]):
        _check_task_cell(path, i, cell)
    return results


def _is_length(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_task_cell(path: Path, index: int, cell: object) -> None:
    """:class:`ReportError` naming the cell and its field unless ``cell`` is a task cell."""
    if not isinstance(cell, dict):
        raise ReportError(f"{path}: cell {index} is {cell!r}, not an object with "
                          f"{', '.join(_TASK_CELL_KEYS)}")
    missing = [key for key in _TASK_CELL_KEYS if key not in cell]
    if missing:
        raise ReportError(f"{path}: cell {index} is not a task cell (no {', '.join(missing)})")
    checks = (
        ("task", isinstance(cell["task"], str), "a task name"),
        ("length", _is_length(cell["length"]), "a positive integer"),
        ("score", _is_number(cell["score"]) and 0 <= cell["score"] <= 1,
         "a number from 0 to 1"),
        ("samples", isinstance(cell["samples"], int) and not isinstance(cell["samples"], bool)
         and cell["samples"] >= 0, "a count"),
    )
    for key, valid, what in checks:
        if not valid:
            raise ReportError(f"{path}: cell {index}: {key} is {cell[key]!r}, not {what}")


def _tasks_figure(results: dict, title: str) -> Figure:
    """Score (×100) against context length: a panel per task, up to three across, each point
    annotated with the samples it scored. Every panel has the same lengths on its axis."""
    names = _task_names([results])
    lengths = _task_lengths([results])
    fig, axes = _task_panels(names)
    for ax, name in zip(axes, names, strict=True):
        cells = sorted((c["length"], c["score"] * 100, c["samples"]) for c in results["cells"]
                       if c["task"] == name)
        if cells:
            ax.plot([n for n, _, _ in cells], [s for _, s, _ in cells], color="C0", marker="o",
                    linewidth=1.6)
            for length, score, samples in cells:
                above = score < 85  # near the top, the label goes under the point
                ax.annotate(f"n={samples}", (length, score), textcoords="offset points",
                            xytext=(0, 7 if above else -9), ha="center",
                            va="bottom" if above else "top", fontsize="x-small", color="C0")
        else:
            _no_cells_yet(ax)
        _length_axis(ax, lengths)
        ax.set_xlabel("context length (tokens)")
        _score_panel(ax, name)
    fig.suptitle(_tasks_title(title, [results]), fontweight="bold")
    return fig


def _tasks_by_step_figure(evaluations: list[tuple[int, dict]], title: str) -> Figure:
    """Score (×100) against training step, in :func:`_tasks_figure`'s panels: a line per
    context length (the same colour in every panel), a point per evaluation that scored it.

    Args:
        evaluations: ``(step, results)`` in step order (:func:`read_task_results_by_step`).
    """
    everything = [results for _, results in evaluations]
    names = _task_names(everything)
    lengths = _task_lengths(everything)
    fig, axes = _task_panels(names)
    for ax, name in zip(axes, names, strict=True):
        for i, length in enumerate(lengths):
            points = [(step, c["score"] * 100) for step, results in evaluations
                      for c in results["cells"] if c["task"] == name and c["length"] == length]
            if points:
                ax.plot([s for s, _ in points], [y for _, y in points], color=f"C{i}",
                        marker="o", linewidth=1.6, label=_length_label(length))
        if ax.get_lines():
            ax.legend(title="context length", loc="best", fontsize="small")
        else:
            _no_cells_yet(ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("training step")
        _score_panel(ax, name)
    fig.suptitle(_tasks_title(title, everything), fontweight="bold")
    return fig


def _task_names(evaluations: list[dict]) -> list[str]:
    """The listed tasks, then any a cell names that no list does; one panel at least."""
    names = dict.fromkeys(name for results in evaluations for name in results["tasks"])
    names |= dict.fromkeys(c["task"] for results in evaluations for c in results["cells"])
    return list(names) or ["(no tasks)"]


def _task_lengths(evaluations: list[dict]) -> list[int]:
    return sorted({length for results in evaluations
                   for length in [*results["lengths"], *(c["length"] for c in results["cells"])]})


def _task_panels(names: list[str]) -> tuple[Figure, list[Axes]]:
    """A figure with a panel per task, up to three across; the panels in ``names``' order."""
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    fig = Figure(figsize=(max(6.0, 4.8 * columns), 3.8 * rows), layout="constrained")
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax in axes[len(names):]:  # the last row's empty places
        fig.delaxes(ax)
    return fig, axes[:len(names)]


def _no_cells_yet(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no cells yet", transform=ax.transAxes, ha="center", va="center",
            color="grey")


def _score_panel(ax: Axes, name: str) -> None:
    """A task's panel: its name, and the score axis from 0 to 100."""
    ax.set_ylim(-5, 105)  # room for the markers of 0 and 100
    ax.set_yticks(range(0, 101, 20))
    ax.set_title(name)
    ax.set_ylabel("score (×100)")
    ax.grid(True, alpha=0.3)


def _tasks_title(title: str, evaluations: list[dict]) -> str:
    """``<run> · lm_eval <version>``, each version the evaluations name, in their order."""
    versions = []
    for results in evaluations:
        settings = results.get("settings")
        version = settings.get("lm_eval") if isinstance(settings, dict) else None
        if version and str(version) not in versions:
            versions.append(str(version))
    return f"{title} · lm_eval {', '.join(versions) or '(version unknown)'}"


def _length_axis(ax: Axes, lengths: list[int]) -> None:
    """A log2 axis with a tick at each evaluated length (4k, 8k, ...), half an octave of room
    on either side."""
    ax.set_xscale("log", base=2)
    if not lengths:
        return
    ax.set_xlim(lengths[0] / math.sqrt(2), lengths[-1] * math.sqrt(2))
    ax.set_xticks(lengths, [_length_label(n) for n in lengths])
    ax.minorticks_off()


def _length_label(tokens: int) -> str:
    """``4096`` -> ``4k``, ``1536`` -> ``1.5k``; under 1024, the number."""
    return str(tokens) if tokens < 1024 else f"{tokens / 1024:g}k"


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
