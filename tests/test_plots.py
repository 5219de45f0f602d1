"""``ringray report``: PNGs from a run's steps.jsonl, and one-line errors for what is not a run.

The synthetic run is written with :class:`StepStats` itself, so the report reads the very
records the trainer writes. A real run's report is checked by eye (see the issue's note).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringray.cli import app
from ringray.plots import ReportError, read_restart_steps, read_steps, write_report
from ringray.train.step_stats import StepStats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAMES = ["loss", "tokens_per_second", "overlap", "load_imbalance", "overview"]


def _stats(step: int, *, rings: int = 2) -> StepStats:
    return StepStats(
        step=step, loss=6.0 / step, grad_norm=1.0, learning_rate=1e-3, step_seconds=0.5,
        tokens=8192, tokens_per_second=16384.0 + step, attention_compute_seconds=[0.2] * 4,
        exposed_comm_seconds=[0.01] * 4, overlap_ratio=0.8 - 0.01 * step,
        load_imbalance=1.02 + 0.001 * step, mfu=None, peak_memory_bytes=2**30,
        overlap_ratio_per_ring=[0.8 - 0.01 * step, 0.9][:rings],
        load_imbalance_per_ring=[1.01, 1.02 + 0.001 * step][:rings],
        ring_bytes_sent=[2**20] * 4, peak_memory_bytes_per_rank=[2**30] * 4,
        peer_wait_seconds=[0.0, 0.001 * step, 0.0, 0.0], peer_wait_seconds_max=0.001 * step,
    )


def _write_run(run_dir: Path, steps: int = 12, *, restart_at: int | None = 5) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "steps.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps(_stats(step).to_dict()) + "\n")
    events = [{"time": 1.0, "state": "starting", "message": "started 4 workers (dp=2 × cp=2) "
               "at step 0"}]
    if restart_at is not None:
        events.append({"time": 2.0, "state": "starting", "message": "started 4 workers "
                       f"(dp=2 × cp=2) at step {restart_at}, restored /ckpt/step-{restart_at}"})
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_writes_one_valid_png_per_plot(tmp_path):
    """Five PNGs (four plots and an overview) in <run>/report, each a real image."""
    run = _write_run(tmp_path / "run")
    paths = write_report(run)
    assert paths == [run / "report" / f"{name}.png" for name in NAMES]
    for path in paths:
        width, height = _png_size(path)
        assert width >= 600 and height >= 300, (path, width, height)
        assert path.stat().st_size > 10_000, path  # axes, lines and text, not a blank canvas


def test_report_into_another_directory_and_without_per_ring_fields(tmp_path):
    """--out is created; records from before the per-ring fields (older runs) still plot."""
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for step in range(1, 4):
        record = _stats(step).to_dict()
        del record["overlap_ratio_per_ring"], record["load_imbalance_per_ring"]
        lines.append(json.dumps(record))
    (run / "steps.jsonl").write_text("\n".join(lines) + "\n")
    paths = write_report(run, tmp_path / "out" / "plots")
    assert [p.parent for p in paths] == [tmp_path / "out" / "plots"] * len(NAMES)
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def test_restarts_come_from_workers_started_after_step_0(tmp_path):
    run = _write_run(tmp_path / "run", restart_at=5)
    assert read_restart_steps(run / "events.jsonl") == [5]
    assert read_restart_steps(tmp_path / "missing.jsonl") == []


def test_a_live_runs_torn_last_line_is_left_out(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(_stats(1).to_dict()) + "\n" + '{"step": 2, "lo')
    assert [s["step"] for s in read_steps(path)] == [1]


@pytest.mark.parametrize("content, message", [
    (None, "steps.jsonl: not found"),
    ("", "steps.jsonl: no steps recorded"),
    ("\n\n", "steps.jsonl: no steps recorded"),
    ("not json\n", "steps.jsonl:1: not JSON"),
    ('{"step": 1}\n', "steps.jsonl:1: not a step record (no loss, tokens_per_second"),
])
def test_unreadable_runs_are_one_line_errors_naming_the_file(tmp_path, content, message):
    if content is not None:
        (tmp_path / "steps.jsonl").write_text(content)
    with pytest.raises(ReportError, match=message.replace("(", r"\(")) as info:
        write_report(tmp_path)
    assert "\n" not in str(info.value)
    assert str(tmp_path / "steps.jsonl") in str(info.value)


def test_missing_run_directory(tmp_path):
    with pytest.raises(ReportError, match="no such run directory"):
        write_report(tmp_path / "nope")


def test_cli_prints_the_written_paths(tmp_path):
    run = _write_run(tmp_path / "run")
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == [str(tmp_path / "out" / f"{n}.png") for n in NAMES]
    assert all((tmp_path / "out" / f"{n}.png").is_file() for n in NAMES)


def test_cli_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    output = " ".join(result.output.split())  # rich wraps long lines at the runner's width
    assert result.exit_code == 2
    assert output == f"error: {tmp_path / 'nope'}: no such run directory"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "steps.jsonl").write_text("")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "run")])
    assert result.exit_code == 2 and "no steps recorded" in " ".join(result.output.split())
    run = _write_run(tmp_path / "good")
    for out, message in ((tmp_path / "good" / "steps.jsonl", "is a file; give a directory"),
                         (Path("/proc/ringray-report"), "cannot be created: /proc is not "
                                                         "writable")):
        if not out.parent.exists():
            continue
        result = CliRunner().invoke(app, ["report", str(run), "--out", str(out)])
        output = " ".join(result.output.split())  # a traceback through savefig, before
        assert result.exit_code == 2, result.output
        assert output.startswith(f"error: --out: '{out}' ") and message in output, output


def test_peer_wait_is_plotted_beside_the_overlap_on_its_own_axis():
    """The overlap plot carries the longest peer wait per step on a second axis, in seconds,
    with the step records' values; a run written before the figure existed has no such axis."""
    from matplotlib.figure import Figure

    from ringray.plots import PLOTS

    records = [_stats(step).to_dict() for step in range(1, 6)]
    fig = Figure()
    PLOTS["overlap"](fig.subplots(), records, [])
    overlap_ax, wait_ax = fig.axes
    (line,) = wait_ax.get_lines()
    assert list(line.get_ydata()) == pytest.approx([0.001 * s for s in range(1, 6)])
    assert wait_ax.get_ylabel() == "waiting for a late peer (s)"
    legend = [t.get_text() for t in overlap_ax.get_legend().get_texts()]
    assert "peer wait, longest rank (s)" in legend and "job (worst rank)" in legend
    for record in records:
        del record["peer_wait_seconds_max"]
    old = Figure()
    PLOTS["overlap"](old.subplots(), records, [])
    assert len(old.axes) == 1


def test_ulysses_all_to_all_is_plotted_on_the_seconds_axis():
    """A job with Ulysses groups records each rank's all-to-all seconds; the overlap plot
    draws the longest rank's per step on the seconds axis beside the peer wait. Jobs without
    Ulysses record an empty list and get no such line."""
    from matplotlib.figure import Figure

    from ringray.plots import PLOTS

    records = [_stats(step).to_dict() for step in range(1, 6)]
    for step, record in enumerate(records, start=1):
        record["a2a_seconds"] = [0.01 * step, 0.02 * step, 0.0, 0.005]
    fig = Figure()
    PLOTS["overlap"](fig.subplots(), records, [])
    overlap_ax, seconds_ax = fig.axes
    lines = {line.get_label(): list(line.get_ydata()) for line in seconds_ax.get_lines()}
    assert lines["Ulysses all-to-all, longest rank (s)"] == pytest.approx(
        [0.02 * s for s in range(1, 6)])
    assert lines["peer wait, longest rank (s)"] == pytest.approx([0.001 * s for s in range(1, 6)])
    assert seconds_ax.get_ylabel() == "seconds per step"
    legend = [t.get_text() for t in overlap_ax.get_legend().get_texts()]
    assert "Ulysses all-to-all, longest rank (s)" in legend
    plain = [_stats(step).to_dict() for step in range(1, 6)]
    assert all(record["a2a_seconds"] == [] for record in plain)
    fig = Figure()
    PLOTS["overlap"](fig.subplots(), plain, [])
    labels = [line.get_label() for line in fig.axes[1].get_lines()]
    assert labels == ["peer wait, longest rank (s)"]


_CELL = {"length": 1024, "depth": 0.5, "accuracy": 1.0}


@pytest.mark.parametrize(("name", "content", "message"), [
    ("steps.jsonl", b"\xff\xfe\n", r"steps.jsonl: not UTF-8 text \(byte 0: b'\\xff'\)"),
    ("steps.jsonl", json.dumps({"step": "x", "loss": 1.0, "tokens_per_second": 1.0,
                                "overlap_ratio": None, "load_imbalance": 1.0}).encode() + b"\n",
     r"steps.jsonl:1: not a step record \(step is 'x', not a number\)"),
    ("passkey.json", b"\xff\xfe", r"passkey.json: not UTF-8 text"),
    ("passkey.json", b'{"cells": []}', r"passkey.json: not a passkey report \(no cells"),
    ("passkey.json", json.dumps({"cells": [_CELL, {**_CELL, "length": "x"}]}).encode(),
     r"passkey.json: cell 1 is not a passkey cell"),
    ("passkey.json", json.dumps({"cells": [{**_CELL, "depth": None}]}).encode(),
     r"passkey.json: cell 0 is not a passkey cell"),
    ("passkey.json", json.dumps({"cells": [{**_CELL, "length": [1]}]}).encode(),
     r"passkey.json: cell 0 is not a passkey cell"),
    ("passkey.json", json.dumps({"cells": [_CELL], "chance": 5}).encode(),
     r"passkey.json: 'chance' is 5, not an object of accuracies"),
])
def test_a_damaged_file_is_one_report_error(tmp_path, name, content, message):
    """Each was a traceback (UnicodeDecodeError, ValueError, TypeError, AttributeError) or a
    plot with a categorical axis, before."""
    run = _write_run(tmp_path / "run")
    (run / name).write_bytes(content)
    with pytest.raises(ReportError, match=message):
        write_report(run)
