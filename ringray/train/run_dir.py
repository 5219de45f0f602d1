"""The writer's side of a run directory: its lock, ``steps.jsonl``, ``passkey.json``, ``eval/``.

    run_dir = RunDirectory("runs/quickstart", job="quickstart")
    note = run_dir.open()                # the lock (its heartbeat keeps it fresh); RunDirInUse
    run_dir.restarted_at(step)           # steps.jsonl cut back to the restored step
    run_dir.record_step(stats)           # one line per step
    run_dir.record_passkey(report)       # passkey.json
    run_dir.record_task_evaluation(files)  # eval/results.json, samples.jsonl, lm_eval.log
    run_dir.write_run_spec(text)         # job.yaml, whole, once the job has started
    run_dir.close()                      # the lock released

One process writes a run directory: rank 0 under torchrun (:func:`ringray.train.loop.
run_training`), the job's controller under Ray (:class:`ringray.cluster.record.JobRecord`). The
ranks' collective part of a run is :class:`ringray.train.session.TrainingSession`; what it
returns is recorded here, by the same code on both paths.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import fsspec

from ringray.data import PasskeyReport
from ringray.train.run_lock import RunLock
from ringray.train.step_stats import StepStats

STEPS_LOG = "steps.jsonl"
EVENTS_LOG = "events.jsonl"
PASSKEY_REPORT = "passkey.json"
TASK_EVALUATION = "eval"
"""The directory of the job's lm_eval task evaluation (``ringray eval RUN`` writes there
too)."""
RUN_SPEC = "job.yaml"
"""The job file as run (:mod:`ringray.spec.run_spec` makes its text)."""


def write_run_spec_file(run_dir: str | Path, text: str) -> Path:
    """Write ``RUN/job.yaml`` whole (written aside, then moved into place: a reader never
    sees half of it); returns its path."""
    path = Path(run_dir) / RUN_SPEC
    partial = path.with_name(f".{RUN_SPEC}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)
    return path


PRETRAINED_COPY = "pretrained"
"""``RUN/pretrained``: the ``model.from_pretrained`` checkpoint's config.json and tokenizer
files as the run used them (not its weights), so the run can be exported once the source is
gone (:func:`ringray.spec.run_spec.relocation` reads the run from it then)."""


def keep_pretrained_files(run_dir: str | Path, source: str) -> list[str]:
    """Copy ``source``'s config.json and tokenizer files (those present) into
    ``RUN/pretrained``, each written aside and moved into place; returns their names.

    Raises:
        OSError: ``source`` or the run directory cannot be read or written.
    """
    from ringray.model.hf import TOKENIZER_FILES

    fs, root = fsspec.core.url_to_fs(source)
    target = Path(run_dir) / PRETRAINED_COPY
    target.mkdir(parents=True, exist_ok=True)
    kept = []
    for name in ("config.json", *TOKENIZER_FILES):
        path = f"{root.rstrip('/')}/{name}"
        if not fs.exists(path):
            continue
        partial = target / f".{name}.{os.getpid()}.partial"
        partial.write_bytes(fs.cat_file(path))
        os.replace(partial, target / name)
        kept.append(name)
    return kept


class StepsLog:
    """A run's ``steps.jsonl``: one :class:`StepStats` per line, in step order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def truncate(self, last_step: int) -> list[str]:
        """Drop the lines after ``last_step`` (the steps a resumed run does again); returns a
        warning per line that cannot be read (a torn last line after a crash, say), which is
        dropped too rather than failing the run."""
        if not self.path.exists():
            return []
        kept, warnings = [], []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
                if not isinstance(step, int):
                    raise TypeError(f"step is {type(step).__name__}")
            except (ValueError, KeyError, TypeError) as exc:
                warnings.append(f"{self.path}:{number}: dropped an unreadable line "
                                f"({type(exc).__name__}: {exc}; {line[:40]!r})")
                continue
            if step <= last_step:
                kept.append(line)
        self.path.write_text("".join(f"{line}\n" for line in kept))
        return warnings

    def append(self, stats: StepStats) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(stats.to_dict()) + "\n")


def move_logs_aside(run_dir: Path, suffix: str) -> list[str]:
    """When an earlier run's checkpoints were moved aside: its ``steps.jsonl`` and
    ``events.jsonl`` go with them (``steps.previous-<time>.jsonl``); returns what moved."""
    moved = []
    for name in (STEPS_LOG, EVENTS_LOG):
        path = run_dir / name
        if path.exists():
            target = run_dir / f"{path.stem}.{suffix}{path.suffix}"
            path.rename(target)
            moved.append(str(target))
    return moved


class RunDirectory:
    """One run directory, as its single writer sees it."""

    def __init__(self, path: str | Path, *, job: str) -> None:
        self.path = Path(path)
        self.lock = RunLock(self.path, job=job)
        self.steps = StepsLog(self.path / STEPS_LOG)

    def open(self) -> str | None:
        """Take the run directory's lock (kept fresh by its heartbeat until :meth:`close`);
        a note when a stale lock was taken over.

        Raises:
            RunDirInUse: another live run holds it.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        return self.lock.acquire()

    def close(self) -> None:
        self.lock.release()

    def moved_aside(self, location: str) -> list[str]:
        """An earlier run's checkpoints went to ``location``: its logs follow them."""
        return move_logs_aside(self.path, location.rsplit(".", 1)[-1])

    def restarted_at(self, step: int) -> list[str]:
        """The trainers stand at ``step``: the log keeps the steps behind those weights.
        Returns warnings about lines that could not be read (see :meth:`StepsLog.truncate`)."""
        return self.steps.truncate(step)

    def record_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def write_run_spec(self, text: str) -> Path:
        """``job.yaml`` (:func:`write_run_spec_file`)."""
        return write_run_spec_file(self.path, text)

    def keep_pretrained(self, source: str) -> list[str]:
        """``RUN/pretrained`` (:func:`keep_pretrained_files`)."""
        return keep_pretrained_files(self.path, source)

    def record_passkey(self, report: PasskeyReport) -> None:
        (self.path / PASSKEY_REPORT).write_text(json.dumps(report.to_dict(), indent=2))

    def record_task_evaluation(self, files: Mapping[str, str], *,
                               step: int | None = None) -> Path:
        """``eval/`` (after training), or ``eval/step_<step>/`` (at an interval
        checkpoint): the files of the job's lm_eval task evaluation (``results.json``,
        ``samples.jsonl``, ``lm_eval.log``), each replaced whole; returns the directory."""
        directory = self.path / TASK_EVALUATION
        if step is not None:
            directory = directory / f"step_{step:08d}"
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            if Path(name).name != name:
                raise ValueError(f"record_task_evaluation: {name!r} is not a file name")
            partial = directory / f"{name}.partial"
            partial.write_text(text, encoding="utf-8")
            partial.replace(directory / name)
        return directory
