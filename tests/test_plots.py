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
from ringray.plots import (
    ReportError,
    read_restart_steps,
    read_steps,
    read_task_results,
    read_task_results_by_step,
    write_report,
)
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


_TASK_CELL = {"task": "niah_single_1", "length": 4096, "score": 0.95, "samples": 20,
              "build_seconds": 1.5, "eval_seconds": 30.0}


def _task_results(cells: list[dict] | None = None) -> dict:
    """``eval/results.json`` as :func:`ringray.harness.evaluate.evaluate_plan` writes it: two
    tasks by three lengths, ruler_vt at 16k not run yet."""
    if cells is None:
        scores = {("niah_single_1", 4096): 1.0, ("niah_single_1", 8192): 0.95,
                  ("niah_single_1", 16384): 0.6, ("ruler_vt", 4096): 0.8,
                  ("ruler_vt", 8192): 0.25}
        cells = [{**_TASK_CELL, "task": task, "length": length, "score": score,
                  "samples": 20 if length < 16384 else 10}
                 for (task, length), score in scores.items()]
    return {"model": {"pretrained": "/runs/r/export"},
            "settings": {"cp": 2, "limit": 20, "max_length": 16384, "model_args": {},
                         "gen_kwargs": None, "lm_eval": "0.4.13"},
            "tasks": ["niah_single_1", "ruler_vt"], "lengths": [4096, 8192, 16384],
            "cells": cells, "skipped": [], "seconds": 321.5}


def _write_task_results(run: Path, results: dict | str) -> Path:
    (run / "eval").mkdir(parents=True, exist_ok=True)
    path = run / "eval" / "results.json"
    path.write_text(results if isinstance(results, str) else json.dumps(results, indent=2))
    return path


def test_task_results_are_plotted_after_passkey(tmp_path):
    """eval/results.json (from ringray eval RUN, or the job) adds tasks.png, after
    passkey.png when the run holds both; a cell not run yet does not stop it."""
    run = _write_run(tmp_path / "run")
    _write_task_results(run, _task_results())
    paths = write_report(run)
    assert paths == [run / "report" / f"{name}.png" for name in [*NAMES, "tasks"]]
    width, height = _png_size(run / "report" / "tasks.png")
    assert width >= 600 and height >= 300, (width, height)
    assert (run / "report" / "tasks.png").stat().st_size > 10_000
    (run / "passkey.json").write_text(json.dumps({"cells": [_CELL]}))
    paths = write_report(run, tmp_path / "out")
    assert paths == [tmp_path / "out" / f"{name}.png"
                     for name in [*NAMES, "passkey", "tasks"]]


def test_task_figure_has_a_panel_per_task_with_scores_lengths_and_samples():
    """Per task: score x100 at each length run (a missing cell is left out), on a log2 axis
    labelled 4k/8k/16k, each point annotated with its samples; a task with no cells says so;
    the title names lm_eval's version."""
    from ringray.plots import _tasks_figure

    results = _task_results()
    fig = _tasks_figure(results, "run")
    niah, vt = fig.axes
    assert [niah.get_title(), vt.get_title()] == ["niah_single_1", "ruler_vt"]
    (line,) = niah.get_lines()
    assert list(line.get_xdata()) == [4096, 8192, 16384]
    assert list(line.get_ydata()) == pytest.approx([100.0, 95.0, 60.0])
    (line,) = vt.get_lines()
    assert list(line.get_xdata()) == [4096, 8192]
    assert list(line.get_ydata()) == pytest.approx([80.0, 25.0])
    for ax in (niah, vt):
        assert ax.get_xscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4k", "8k", "16k"]
        assert ax.get_ylim()[0] <= 0 and ax.get_ylim()[1] >= 100
    assert [t.get_text() for t in niah.texts] == ["n=20", "n=20", "n=10"]
    assert [t.get_text() for t in vt.texts] == ["n=20", "n=20"]
    assert fig.get_suptitle() == "run · lm_eval 0.4.13"

    results["cells"] = [c for c in results["cells"] if c["task"] == "niah_single_1"]
    results["tasks"] += ["ruler_cwe", "ruler_fwe"]  # four tasks: a second row
    fig = _tasks_figure(results, "run")
    assert len(fig.axes) == 4
    assert [t.get_text() for t in fig.axes[1].texts] == ["no cells yet"]
    assert fig.axes[1].get_lines() == []


def test_length_labels():
    from ringray.plots import _length_label

    assert [_length_label(n) for n in (512, 1000, 1024, 1536, 4096, 131072)] == [
        "512", "1000", "1k", "1.5k", "4k", "128k"]


def test_no_eval_directory_no_tasks_plot(tmp_path):
    """Without eval/results.json (no evaluation, or one that has not written yet) there is no
    tasks.png, and no error."""
    run = _write_run(tmp_path / "run")
    (run / "eval").mkdir()  # ringray eval made the directory but has not written results
    assert read_task_results(run) is None
    assert write_report(run) == [run / "report" / f"{name}.png" for name in NAMES]
    assert not (run / "report" / "tasks.png").exists()


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", r"results.json: not JSON"),
    (json.dumps({"tasks": [], "cells": []}), r"results.json: not an lm_eval results file "
                                              r"\(no lengths\)"),
    (json.dumps(_task_results([{"task": "ruler_vt", "length": 4096, "samples": 20}])),
     r"results.json: cell 0 is not a task cell \(no score\)"),
    (json.dumps(_task_results([_TASK_CELL, {**_TASK_CELL, "score": "0.5"}])),
     r"results.json: cell 1: score is '0.5', not a number"),
    (json.dumps(_task_results([{**_TASK_CELL, "length": "4k"}])),
     r"results.json: cell 0: length is '4k', not a positive integer"),
    (json.dumps(_task_results([{**_TASK_CELL, "score": 95.0}])),
     r"results.json: cell 0: score is 95.0, not a number from 0 to 1"),
    (json.dumps({**_task_results(), "lengths": "4096"}),
     r"results.json: lengths is '4096', not a list of positive integers"),
])
def test_a_damaged_task_results_file_is_one_report_error(tmp_path, content, message):
    """A malformed eval/results.json is one line naming the file and what is wrong in it."""
    run = _write_run(tmp_path / "run")
    path = _write_task_results(run, content)
    with pytest.raises(ReportError, match=message) as info:
        write_report(run)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def _step_results(step: int) -> dict:
    """The job's evaluation of its checkpoint at ``step``: niah_single_1 improving with the
    step at 4k and 8k, its 16k cell not run at step 2; ruler_vt at 4k only."""
    scores = {("niah_single_1", 4096): 0.5 + 0.05 * step, ("niah_single_1", 8192): 0.1 * step,
              ("ruler_vt", 4096): 0.1 + 0.1 * step}
    if step > 2:
        scores[("niah_single_1", 16384)] = 0.05 * step
    cells = [{**_TASK_CELL, "task": task, "length": length, "score": score}
             for (task, length), score in scores.items()]
    return {**_task_results(cells), "model": {"pretrained": "/ckpt/export", "run": "/runs/r",
                                              "step": step}}


def _write_step_results(run: Path, step: int, results: dict | None = None) -> Path:
    """``eval/step_<step>/results.json``, where ``RunDirectory.record_task_evaluation`` puts
    the evaluation at an interval checkpoint."""
    directory = run / "eval" / f"step_{step:08d}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "results.json"
    path.write_text(json.dumps(results if results is not None else _step_results(step)))
    return path


def test_evaluations_at_checkpoints_are_plotted_by_step_after_tasks(tmp_path):
    """eval/step_<N>/results.json (eval.tasks_at_checkpoints) add tasks_by_step.png right
    after tasks.png; a step directory whose evaluation has not written results yet is
    left out."""
    run = _write_run(tmp_path / "run")
    _write_step_results(run, 4)
    _write_step_results(run, 2)
    (run / "eval" / f"step_{8:08d}").mkdir()  # the checkpoint at step 8: still evaluating
    _write_task_results(run, _step_results(6))
    paths = write_report(run)
    assert paths == [run / "report" / f"{name}.png"
                     for name in [*NAMES, "tasks", "tasks_by_step"]]
    width, height = _png_size(run / "report" / "tasks_by_step.png")
    assert width >= 600 and height >= 300, (width, height)
    assert [step for step, _ in read_task_results_by_step(run)] == [2, 4, 6]


def test_task_by_step_figure_has_a_line_per_length_through_the_final_evaluation(tmp_path):
    """Per task (the panels of tasks.png): score x100 against the step of every evaluation
    that scored the cell, the final one (model.step 6) last; one line per length, labelled
    as tasks.png labels lengths; the score axis is tasks.png's."""
    from ringray.plots import _tasks_by_step_figure, _tasks_figure

    run = tmp_path / "run"
    _write_step_results(run, 2)
    _write_step_results(run, 4)
    _write_task_results(run, _step_results(6))
    fig = _tasks_by_step_figure(read_task_results_by_step(run), "run")
    niah, vt = fig.axes
    assert [niah.get_title(), vt.get_title()] == ["niah_single_1", "ruler_vt"]
    at_4k, at_8k, at_16k = niah.get_lines()
    assert [list(line.get_xdata()) for line in (at_4k, at_8k)] == [[2, 4, 6], [2, 4, 6]]
    assert list(at_4k.get_ydata()) == pytest.approx([60.0, 70.0, 80.0])
    assert list(at_8k.get_ydata()) == pytest.approx([20.0, 40.0, 60.0])
    assert list(at_16k.get_xdata()) == [4, 6]  # not run at step 2
    assert list(at_16k.get_ydata()) == pytest.approx([20.0, 30.0])
    assert [t.get_text() for t in niah.get_legend().get_texts()] == ["4k", "8k", "16k"]
    (line,) = vt.get_lines()
    assert list(line.get_xdata()) == [2, 4, 6]
    assert list(line.get_ydata()) == pytest.approx([30.0, 50.0, 70.0])
    assert [t.get_text() for t in vt.get_legend().get_texts()] == ["4k"]
    assert line.get_color() == at_4k.get_color()  # a length's colour is the same everywhere
    tasks = _tasks_figure(_step_results(6), "run")
    for ax, same in zip(fig.axes, tasks.axes, strict=True):
        assert ax.get_ylim() == same.get_ylim()
        assert ax.get_xlabel() == "training step"
    assert fig.get_suptitle() == "run · lm_eval 0.4.13"


def test_no_evaluations_at_checkpoints_no_by_step_plot(tmp_path):
    """Only the final eval/results.json (no step_* directory, or none with results yet):
    tasks.png alone, even when the final results have no model.step."""
    run = _write_run(tmp_path / "run")
    _write_task_results(run, _task_results())
    assert read_task_results_by_step(run) == []
    assert write_report(run) == [run / "report" / f"{name}.png" for name in [*NAMES, "tasks"]]
    (run / "eval" / f"step_{2:08d}").mkdir()
    assert read_task_results_by_step(run) == []
    assert write_report(run)[-1] == run / "report" / "tasks.png"
    assert not (run / "report" / "tasks_by_step.png").exists()


@pytest.mark.parametrize(("model", "message"), [
    ({"pretrained": "/ckpt/export"}, r"no model\.step"),
    ({"pretrained": "/ckpt/export", "step": "4"}, r"model\.step is '4', not a training step"),
    ({"pretrained": "/ckpt/export", "step": True}, r"model\.step is True, not a training step"),
    (None, r"no model\.step"),
])
def test_a_step_evaluation_without_its_step_is_one_report_error(tmp_path, model, message):
    """An evaluation at a checkpoint whose results.json does not say its step is one line
    naming the file and model.step; so is the final one beside evaluations at checkpoints."""
    run = _write_run(tmp_path / "run")
    _write_step_results(run, 2)
    results = _step_results(4)
    if model is None:
        del results["model"]
    else:
        results["model"] = model
    path = _write_step_results(run, 4, results)
    with pytest.raises(ReportError, match=message) as info:
        write_report(run)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)

    path.write_text(json.dumps(_step_results(4)))
    final = _write_task_results(run, _task_results())  # no model.step
    with pytest.raises(ReportError, match=r"no model\.step") as info:
        write_report(run)
    assert str(info.value).startswith(f"{final}: ")


def test_a_damaged_step_evaluation_is_one_report_error_naming_it(tmp_path):
    """eval/step_<N>/results.json is checked as eval/results.json is, the error naming it."""
    run = _write_run(tmp_path / "run")
    path = _write_step_results(run, 2, {**_step_results(2), "lengths": "4096"})
    with pytest.raises(ReportError, match=r"lengths is '4096', not a list") as info:
        write_report(run)
    assert str(info.value).startswith(f"{path}: ")
