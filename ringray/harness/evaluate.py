"""One evaluation of RULER's offline tasks × lengths, on rank 0 of a ring (``ringray eval``).

    plan = EvalPlan(pretrained="ckpt/", tasks=("niah_single_1", "ruler_vt"),
                    lengths=(4096, 8192), out="eval/", cp=2, limit=20)
    launch(plan.cp, [plan.to_json()], entry=run_plan)    # cp > 1: python -m ringray.harness's ranks
    results = evaluate_plan(plan)                          # cp == 1: in this process

Each (length, task) cell, shortest length first, is one lm_eval evaluation: the task's data is
built for that length alone (:func:`~ringray.harness.ruler.build_task`), then
``simple_evaluate`` runs it with the ``ringray`` model (every forward round the ring), on the
first ``limit`` samples. A cell's data is the same whichever cells run with it.

What it writes under ``out``:

- ``results.json``: the settings, and per cell the score (the mean of lm_eval's per-sample
  RULER score: the fraction of the expected answers found in the generated text; for
  ``ringray_passkey``, whether the key was the argmax), the samples scored, and the seconds
  spent building the data and evaluating; rewritten after every cell;
- ``samples.jsonl``: one line per sample: its prompt's hash (lm_eval's), its length as the
  generator counts it (RULER: the prompt's tokens plus those left for the answer), the
  expected answers, what the model generated (or its log-likelihood and greedy flag) and the
  score;
- ``lm_eval.log``: what lm_eval and the data generators print.

Progress goes to stderr: a bar over the work (each sample weighs its length times one
forward and the tokens it may generate, each a small fraction of a forward with the KV
cache, and attention's growing share of a forward at long lengths:
:func:`~ringray.harness.ruler.weight`), the current cell,
the time spent and the time left (extrapolated from the requests done so far; the first
request's time is printed with an estimate for the whole run), and a line per finished cell.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ringray.harness.ruler import (
    DECODE_STEPS_PER_FORWARD,
    GENERATION_ROOM,
    RULER_SAMPLES,
    attention_even_length,
    weight,
)

RESULTS = "results.json"
SAMPLES = "samples.jsonl"
LOG = "lm_eval.log"
ERROR = "error.txt"


@dataclass(frozen=True, kw_only=True)
class EvalPlan:
    """What to evaluate: a checkpoint, tasks (:data:`~ringray.harness.ruler.OFFLINE_TASKS`),
    lengths, and where to write. JSON round-trips, so a launcher can hand it to rank 0."""

    pretrained: str
    """A local Hugging Face checkpoint directory."""
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    out: str
    cp: int = 1
    limit: int | None = None
    """Samples per cell (default: all lm_eval makes, 500)."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """More ``ringray`` model arguments (``rope.scaling``, ``layout``, ...)."""
    max_length: int | None = None
    """The model's ``max_length`` (default: the longest length plus
    :data:`~ringray.harness.ruler.GENERATION_ROOM`, so that no prompt is cut)."""
    gen_kwargs: dict[str, Any] | None = None
    """Overrides of every task's generation settings (lm_eval's ``gen_kwargs``)."""
    about: dict[str, Any] = field(default_factory=dict)
    """What the caller knows of the model (a run directory, its step), copied into the
    results."""
    skipped: tuple[str, ...] = ()
    """Lines for tasks the caller left out (RULER's downloading tasks), kept in the results."""
    skip_unbuildable: bool = False
    """A cell whose data cannot be made here (:class:`~ringray.harness.ruler.CellNotBuilt`)
    is skipped with a line, not an error (``ringray eval``'s default: every task)."""

    @property
    def model_max_length(self) -> int:
        return self.max_length or max(self.lengths) + GENERATION_ROOM

    def cells(self) -> list[tuple[str, int]]:
        """``(task, length)`` in the order they run: shortest length first."""
        return [(task, length) for length in sorted(self.lengths) for task in self.tasks]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EvalPlan:
        data = json.loads(text)
        for name in ("tasks", "lengths", "skipped"):
            data[name] = tuple(data[name])
        return cls(**data)


# ---------------------------------------------------------------------- progress

@dataclass(frozen=True)
class EvalProgress:
    """What the progress bar shows (:meth:`Reporter.snapshot`): the current cell, the work
    done and in all (samples weighted by :func:`~ringray.harness.ruler.weight`), the samples
    done and in all, and every line printed so far."""

    description: str
    completed: float
    total: float
    done: int
    samples: int
    lines: tuple[str, ...]


_active: Reporter | None = None
_last: EvalProgress | None = None


def progress_now() -> EvalProgress | None:
    """The open :class:`Reporter`'s :class:`EvalProgress` in this process, else the last
    one's at its end (until :func:`forget_progress`); ``None`` before any."""
    reporter = _active
    return reporter.snapshot() if reporter is not None else _last


def forget_progress() -> None:
    """An evaluation starts: :func:`progress_now` says ``None`` until its reporter opens."""
    global _last
    _last = None


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress_bar(console: Any) -> Any:
    """The evaluation's rich progress bar on ``console``: the current cell, the bar, samples
    done of all, time spent and left (a task's fields: ``done`` and ``samples``). Rank 0's
    :class:`Reporter` draws it, and ``ringray eval --address`` where the command runs."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"), BarColumn(),
        TextColumn("{task.fields[done]}/{task.fields[samples]} samples"),
        TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("left"),
        TimeRemainingColumn(),
        console=console, redirect_stdout=False, redirect_stderr=False)


class Reporter:
    """The progress bar and the lines on stderr (see the module docstring). While one is
    open, :func:`progress_now` returns what it shows, for a caller in another thread (a Ray
    worker answering its driver, which draws the bar where the user is)."""

    def __init__(self, cells: list[tuple[str, int]], samples: int, *,
                 max_gen_toks: int | None = None, attention_even: int | None = None,
                 file: TextIO | None = None) -> None:
        from rich.console import Console

        self.console = Console(file=file or sys.stderr, markup=False, emoji=False,
                               highlight=False)
        self.counts = {cell: samples for cell in cells}
        self.max_gen_toks = max_gen_toks
        self.attention_even = attention_even  # ruler.attention_even_length
        self.progress = progress_bar(self.console)
        self.bar = self.progress.add_task("starting", total=self._work(), done=0,
                                          samples=sum(self.counts.values()))
        self.cell: tuple[str, int] | None = None
        self.done = 0
        self.first: float | None = None
        self.started_request = time.monotonic()
        self.lines: list[str] = []

    def _print(self, line: str) -> None:
        self.lines.append(line)
        self.console.print(line)

    def snapshot(self) -> EvalProgress:
        task = self.progress.tasks[0]
        return EvalProgress(description=task.description, completed=task.completed,
                        total=task.total or 0, done=self.done,
                        samples=sum(self.counts.values()), lines=tuple(self.lines))

    def _work(self) -> int:
        return sum(count * self._weight(*cell) for cell, count in self.counts.items())

    def _weight(self, task: str, length: int) -> int:
        return weight(task, length, self.max_gen_toks, even=self.attention_even)

    def __enter__(self) -> Reporter:
        global _active
        self.progress.start()
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active, _last
        _active, _last = None, self.snapshot()
        self.progress.stop()

    def building(self, task: str, length: int) -> None:
        self.cell = (task, length)
        self.progress.update(self.bar, description=f"{task} @ {length}: building its data")

    def ready(self, count: int) -> None:
        """The current cell has ``count`` samples to run (the plan assumed another number)."""
        task, length = self.cell
        self.counts[self.cell] = count
        self.progress.update(self.bar, total=self._work(), samples=sum(self.counts.values()),
                             description=f"{task} @ {length}")

    def request_started(self) -> None:
        self.started_request = time.monotonic()

    def request_done(self) -> None:
        task, length = self.cell
        self.done += 1
        self.progress.update(self.bar, advance=self._weight(task, length), done=self.done)
        if self.first is None:
            self.first = time.monotonic() - self.started_request
            total = self.progress.tasks[0].total
            estimate = self.first * total / self._weight(task, length)
            self._print(
                f"first request ({task} @ {length}): {self.first:.1f} s; estimated time for "
                f"every request: {_duration(estimate)} (time ~ length x {self._grows()}"
                f"(1 + tokens / {DECODE_STEPS_PER_FORWARD}); building each cell's data "
                f"comes on top)")

    def _grows(self) -> str:
        even = self.attention_even
        return f"(1 + length / {even}) x " if even else ""

    def skip(self, task: str, length: int, line: str) -> None:
        """The current cell will not run."""
        self.counts[(task, length)] = 0
        self.progress.update(self.bar, total=self._work(), samples=sum(self.counts.values()))
        self._print(line)

    def cell_done(self, task: str, length: int, score: float, count: int,
                  seconds: float) -> None:
        self._print(f"{task} @ {length}: {100 * score:.1f} ({count} samples, "
                    f"{_duration(seconds)})")


def reporting(inner: Any, before: Callable[[], None], after: Callable[[], None]) -> Any:
    """``inner`` (an lm_eval ``LM``) behind an ``LM`` that hands it one request at a time,
    calling ``before`` and ``after`` each; its other attributes are ``inner``'s."""
    from lm_eval.api.model import LM

    class _Reporting(LM):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.__dict__["inner"], name)

        def _each(self, method: str, requests: list, disable_tqdm: bool = False) -> list:
            answers = []
            for request in requests:
                before()
                answers.extend(getattr(self.inner, method)([request], disable_tqdm=True))
                after()
            return answers

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self._each("loglikelihood", requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self._each("loglikelihood_rolling", requests)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self._each("generate_until", requests)

        @property
        def rank(self) -> int:
            return self.inner.rank

        @property
        def world_size(self) -> int:
            return self.inner.world_size

    return _Reporting()


# ---------------------------------------------------------------------- one cell

def _sample_record(task: str, length: int, sample: dict[str, Any]) -> dict[str, Any]:
    doc = sample["doc"]
    response = sample["filtered_resps"][0]
    record: dict[str, Any] = {
        "task": task, "length": length, "doc_id": sample["doc_id"],
        "prompt_hash": sample["prompt_hash"], "doc_length": doc.get("length"),
        "target": doc.get("outputs"), "score": float(sample[str(length)]),
    }
    if isinstance(response, (list, tuple)):  # loglikelihood: (log p, greedy)
        record["loglikelihood"], record["greedy"] = float(response[0]), bool(response[1])
        record["depth"] = doc.get("depth")
    else:
        record["response"] = response
    return record


def run_cell(lm: Any, task: str, length: int, *, pretrained: str, limit: int | None,
             gen_kwargs: dict[str, Any] | None = None, log: TextIO | None = None,
             reporter: Reporter | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Build ``task``'s data for ``length`` and evaluate ``lm`` (any lm_eval ``LM``) on its
    first ``limit`` samples: ``(the cell's summary, one record per sample)``."""
    from lm_eval.evaluator import evaluate

    from ringray.harness.ruler import build_task

    if reporter is not None:
        reporter.building(task, length)
    started = time.monotonic()
    built = build_task(task, length, pretrained=pretrained, log=log,
                       num_samples=limit if task == "ringray_passkey" else None)
    built_s = time.monotonic() - started
    count = len(built.eval_docs) if limit is None else min(limit, len(built.eval_docs))
    if reporter is not None:
        reporter.ready(count)
        model = reporting(lm, reporter.request_started, reporter.request_done)
    else:
        model = lm
    if gen_kwargs and built.get_config("output_type") == "generate_until":
        built.set_config(key="generation_kwargs", value=dict(gen_kwargs), update=True)
    sink = log if log is not None else open(os.devnull, "w")  # noqa: SIM115
    started = time.monotonic()
    try:
        # lm_eval's evaluate(), as simple_evaluate calls it once the task is set up
        # (build_task); not simple_evaluate itself, which adds the environment's description
        # to every result by running pip in a subprocess (2 s a cell).
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            results = evaluate(lm=model, task_dict={"tasks": {task: built}, "groups": {},
                                                   "group_map": {}},
                               limit=limit, bootstrap_iters=0, log_samples=True,
                               fewshot_as_multiturn=True)
    finally:
        if log is None:
            sink.close()
    seconds = time.monotonic() - started
    records = [_sample_record(task, length, s) for s in results["samples"][task]]
    score = sum(r["score"] for r in records) / len(records)
    cell = {"task": task, "length": length, "score": score, "samples": len(records),
            "seconds": round(seconds, 2), "build_seconds": round(built_s, 2)}
    if reporter is not None:
        reporter.cell_done(task, length, score, len(records), seconds)
    return cell, records


# ---------------------------------------------------------------------- a whole plan

def offline_environment() -> None:
    """Nothing is downloaded: the Hugging Face hub and datasets in offline mode (read when
    they are first imported, so set before)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def evaluate_plan(plan: EvalPlan, *, lm: Any = None, progress_file: TextIO | None = None,
                  ) -> dict[str, Any]:
    """Run every cell of ``plan`` with ``lm`` (default: the ``ringray`` model, a ring of
    ``plan.cp`` ranks whose other ranks serve) and write the results (module docstring);
    returns what ``results.json`` holds."""
    offline_environment()
    import lm_eval
    import transformers

    from ringray.harness.ruler import CellNotBuilt, check_buildable

    tokenizer = transformers.AutoTokenizer.from_pretrained(plan.pretrained)
    cells, skipped = [], []
    for task, length in plan.cells():  # refused before any cell runs, not after some
        try:
            check_buildable(task, length, tokenizer)
            cells.append((task, length))
        except CellNotBuilt as exc:
            if not plan.skip_unbuildable:
                raise
            skipped.append(f"skipped {exc}")
    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ERROR).unlink(missing_ok=True)
    if lm is None:
        from ringray.harness.lm import RingLM

        lm = RingLM(pretrained=plan.pretrained, cp=plan.cp, max_length=plan.model_max_length,
                    **plan.model_args)
    results: dict[str, Any] = {
        "model": {"pretrained": plan.pretrained, **plan.about},
        "settings": {"cp": plan.cp, "limit": plan.limit, "max_length": plan.model_max_length,
                     "model_args": plan.model_args, "gen_kwargs": plan.gen_kwargs,
                     "lm_eval": lm_eval.__version__},
        "tasks": list(plan.tasks), "lengths": sorted(plan.lengths),
        "cells": [], "skipped": [*plan.skipped, *skipped], "seconds": None,
    }
    started = time.monotonic()
    samples = plan.limit or RULER_SAMPLES
    _write_json(out / RESULTS, results)
    with open(out / LOG, "w", encoding="utf-8") as log, \
            open(out / SAMPLES, "w", encoding="utf-8") as sample_file, \
            Reporter(cells, samples, file=progress_file,
                     max_gen_toks=(plan.gen_kwargs or {}).get("max_gen_toks"),
                     attention_even=attention_even_length(plan.pretrained)) as reporter:
        for line in skipped:
            reporter._print(line)
        for task, length in cells:
            try:
                cell, records = run_cell(lm, task, length, pretrained=plan.pretrained,
                                         limit=plan.limit, gen_kwargs=plan.gen_kwargs,
                                         log=log, reporter=reporter)
            except CellNotBuilt as exc:
                if not plan.skip_unbuildable:
                    raise
                results["skipped"].append(f"skipped {exc}")
                reporter.skip(task, length, f"skipped {exc}")
                continue
            results["cells"].append(cell)
            results["seconds"] = round(time.monotonic() - started, 1)
            for record in records:
                sample_file.write(json.dumps(record) + "\n")
            sample_file.flush()
            _write_json(out / RESULTS, results)
    results["seconds"] = round(time.monotonic() - started, 1)
    _write_json(out / RESULTS, results)
    return results


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)


def run_plan(arguments: Sequence[str]) -> None:
    """Rank 0's entry under :func:`ringray.harness.launch.launch`: ``arguments[0]`` is an
    :meth:`EvalPlan.to_json`. A failure is written to ``out/error.txt`` (one line, for the
    command that launched the ring) before the process exits with status 1."""
    plan = EvalPlan.from_json(arguments[0])
    try:
        evaluate_plan(plan)
    except Exception as exc:  # noqa: BLE001 - reported in one line, then the ring ends
        message = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, ValueError):
            message = f"{type(exc).__name__}: {message}"
        Path(plan.out, ERROR).write_text(message + "\n", encoding="utf-8")
        raise SystemExit(1) from None


# ---------------------------------------------------------------------- the table

def format_table(results: dict[str, Any]) -> str:
    """Scores (x100) by task and length, with the samples per cell."""
    lengths = results["lengths"]
    by_cell = {(c["task"], c["length"]): c for c in results["cells"]}
    width = max(len("task"), *(len(t) for t in results["tasks"]))
    lines = ["task".ljust(width) + "".join(f"{n:>12}" for n in lengths)]
    for task in results["tasks"]:
        row = task.ljust(width)
        for length in lengths:
            cell = by_cell.get((task, length))
            row += f"{cell['score'] * 100:>7.1f} ({cell['samples']:>2})" if cell else \
                f"{'-':>12}"
        lines.append(row)
    done = results["cells"]
    if len(results["tasks"]) > 1 and done:
        row = "mean".ljust(width)
        for length in lengths:
            scores = [c["score"] for c in done if c["length"] == length]
            row += f"{100 * sum(scores) / len(scores):>7.1f}     " if scores else f"{'-':>12}"
        lines.append(row)
    lines.append(f"score x100 (samples per cell); lm_eval {results['settings']['lm_eval']}, "
                 f"{results['seconds']} s")
    return "\n".join(lines)
