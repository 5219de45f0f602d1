"""What a job records: the one place its side effects go through (no Ray here).

    record = JobRecord(job, run_dir, metrics=JobMetrics(job.name))
    record.event("placed ...")               # events.jsonl, the status's recent events
    record.event("teardown failed", exc=e)   # ... with the traceback, never swallowed
    record.step(stats)                       # steps.jsonl, metrics, the first step of a recovery
    status = record.status()                 # a JobStatus snapshot, any time, from any thread

The machine (:mod:`ringray.cluster.machine`) and the Ray worker group report here; nothing
else writes the run directory's logs or the job's Prometheus series. The run directory's own
files (lock, ``steps.jsonl``, ``passkey.json``) are written by the same
:class:`~ringray.train.run_dir.RunDirectory` as under torchrun.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

from ringray.cluster.flight_recorder import DUMP_PREFIX, STACKS_PREFIX, WorkerDump, dump_summary
from ringray.cluster.job_options import JobOptions
from ringray.cluster.placement import PlacementPlan
from ringray.cluster.policy import Failure
from ringray.cluster.status import (
    Event,
    JobState,
    JobStatus,
    ReplicaLoss,
    Restart,
    WorkerHealth,
)
from ringray.data import PasskeyReport
from ringray.metrics.exporter import JobMetrics
from ringray.train import CheckpointRef, StepStats
from ringray.train.run_dir import EVENTS_LOG, RunDirectory

EVENTS_KEPT = 100


class JobRecord:
    """The job's logs, metrics and status, safe to read from other threads."""

    def __init__(self, job: JobOptions, run_dir: Path, *, metrics: JobMetrics | None) -> None:
        self.job = job
        self.run_dir = RunDirectory(run_dir, job=job.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._events_path = run_dir / EVENTS_LOG
        self.metrics = metrics
        self.metrics_url: str | None = None
        self._lock = threading.Lock()
        self._state = JobState.PLACING
        self._step = 0
        self._last_stats: StepStats | None = None
        self._nonfinite_skipped = 0  # attempts passed over (train.nonfinite_skips)
        self._plan: PlacementPlan | None = None
        self._workers: tuple[WorkerHealth, ...] = ()
        self._restarts: list[Restart] = []
        self._replica_losses: list[ReplicaLoss] = []
        self._awaiting_first_step: int | None = None  # index of a restart not yet recovered
        self._failures_used = 0
        self._resizes = 0
        self._last_checkpoint_step: int | None = None
        self._error: str | None = None
        self._events: list[Event] = []
        self._held: list[dict] | None = None  # events not yet written (see hold_events)
        self._run_spec_written = False
        if metrics is not None:
            metrics.target(job.replicas * job.dp_max * job.cp, replica_groups=job.replicas)
            metrics.state(self._state.value)

    # ----------------------------------------------------------------- events and state
    def event(self, message: str, *, exc: BaseException | None = None) -> None:
        """One line for the status and ``events.jsonl``; with ``exc``, its traceback too."""
        stamp = time.time()
        with self._lock:
            state = self._state.value
            self._events.append(Event(time=stamp, state=state, message=message))
            del self._events[:-EVENTS_KEPT]
        entry = {"time": stamp, "state": state, "message": message}
        if exc is not None:
            entry["traceback"] = "".join(traceback.format_exception(exc))
        with self._lock:
            if self._held is not None:
                self._held.append(entry)
                return
        self._write_events([entry])

    def _write_events(self, entries: list[dict]) -> None:
        with self._events_path.open("a") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in entries)

    def hold_events(self) -> None:
        """Keep events in memory until :meth:`open_run_dir`: a job refused its run directory
        (another live run holds it) must not write into that run's ``events.jsonl``."""
        with self._lock:
            self._held = []

    def open_run_dir(self) -> str | None:
        """Take the run directory (its lock; ``RunDirInUse`` if a live run holds it), then
        write the events held so far. Returns the lock's note, if any."""
        note = self.run_dir.open()
        with self._lock:
            held, self._held = self._held or [], None
        self._write_events(held)
        return note

    def state(self, state: JobState, *, error: str | None = None) -> None:
        with self._lock:
            changed = state is not self._state
            self._state = state
            if error is not None:
                self._error = error
        if self.metrics is not None:
            self.metrics.state(state.value)
        if changed:
            self.event(f"state: {state.value}")

    # ----------------------------------------------------------------- placement and starts
    def placed(self, plan: PlacementPlan) -> None:
        with self._lock:
            self._plan = plan
            self._workers = ()  # the new workers are probed once they are up
        self.event(plan.describe())

    def workers(self, healths: tuple[WorkerHealth, ...]) -> None:
        with self._lock:
            self._workers = healths
        if self.metrics is not None and self._plan is not None:
            self.metrics.placed(dp=self._plan.dp, cp=self._plan.cp,
                                nodes=[h.node_id for h in healths])

    def moved_aside(self, location: str) -> None:
        """An earlier run's checkpoints were moved aside: its logs go with them."""
        self.event(f"moved the earlier run's checkpoints aside to {location}")
        for moved in self.run_dir.moved_aside(location):
            self.event(f"moved the earlier run's log aside to {moved}")

    def started(self, plan: PlacementPlan, *, step: int, restored: CheckpointRef | None) -> None:
        """The trainers are built at ``step`` (restored from ``restored``)."""
        # steps.jsonl describes the training behind the weights
        for warning in self.run_dir.restarted_at(step):
            self.event(f"warning: {warning}")
        with self._lock:
            self._step = step
            if restored is not None:
                self._last_checkpoint_step = restored.step
            if self._awaiting_first_step is not None:
                index = self._awaiting_first_step
                restart = self._restarts[index]
                self._restarts[index] = replace(
                    restart, resumed_from_step=step, lost_steps=restart.failed_at_step - step,
                    world_size_after=plan.world_size)
        self.event(f"started {plan.world_size} workers (dp={plan.dp} × cp={plan.cp}) at step "
                   f"{step}" + (f", restored {restored.location}" if restored else ""))
        self._write_run_spec()

    def _write_run_spec(self) -> None:
        """``job.yaml``, once the job has started (a refused run never gets here) and once
        per controller (a restart does not write it again)."""
        if self.job.run_spec is None or self._run_spec_written:
            return
        self._run_spec_written = True
        try:
            self.run_dir.write_run_spec(self.job.run_spec)
        except OSError as exc:
            self.event(f"warning: cannot write {self.run_dir.path}/job.yaml ({exc.strerror}); "
                       f"`ringray resume` needs it (train with the same spec instead)")
        source = self.job.train.pretrained
        if source is not None:
            try:
                self.run_dir.keep_pretrained(source)
            except OSError as exc:
                self.event(f"warning: cannot keep {source}'s config.json and tokenizer in "
                           f"{self.run_dir.path}/pretrained ({exc}); `ringray export` needs "
                           f"them once {source} is gone")

    # ----------------------------------------------------------------- training
    def replica_lost(self, index: int, *, reason: str, detail: str, left: int) -> None:
        """Replica group ``index`` was torn down; ``left`` groups train on without it."""
        self.event(f"replica group {index} lost ({reason}: {detail}); {left} of "
                   f"{self.job.replicas} train on without it")
        with self._lock:
            self._replica_losses.append(ReplicaLoss(group=index, reason=reason,
                                                    at_step=self._step))
        if self.metrics is not None:
            self.metrics.replica_lost(reason)

    def replica_healed(self, index: int, *, step: int, seconds: float) -> None:
        """Replica group ``index`` loaded a live peer's state and trained ``step``."""
        self.event(f"replica group {index} healed from a live peer at step {step} in "
                   f"{seconds:.2f} s")
        with self._lock:
            for i in reversed(range(len(self._replica_losses))):
                loss = self._replica_losses[i]
                if loss.group == index and loss.healed_at_step is None:
                    self._replica_losses[i] = replace(loss, healed_at_step=step,
                                                      heal_seconds=seconds)
                    break
        if self.metrics is not None:
            self.metrics.replica_healed(seconds)

    def step(self, stats: StepStats) -> None:
        self.run_dir.record_step(stats)
        if self.metrics is not None:
            self.metrics.step(stats)
        recovered = None
        if stats.nonfinite_skipped:
            self.event(f"step {stats.step}: {stats.nonfinite_skipped} attempt(s) before it "
                       f"passed over, their loss or gradient norm not finite")
        with self._lock:
            self._nonfinite_skipped += stats.nonfinite_skipped
            self._step, self._last_stats = stats.step, stats
            if self._awaiting_first_step is not None:  # the first step since a recovery
                index, self._awaiting_first_step = self._awaiting_first_step, None
                recovered = self._restarts[index] = replace(
                    self._restarts[index],
                    recovery_seconds=time.time() - self._restarts[index].detected_at)
        if recovered is not None:
            if self.metrics is not None:
                self.metrics.recovered(recovered.recovery_seconds)
            self.event(f"recovered from {recovered.reason} in "
                       f"{recovered.recovery_seconds:.1f} s (to the first step done); "
                       f"{recovered.lost_steps} step(s) redone")

    def checkpointed(self, ref: CheckpointRef, *, seconds: float) -> None:
        with self._lock:
            self._last_checkpoint_step = ref.step
        if self.metrics is not None:
            self.metrics.checkpoint(seconds=seconds, step=ref.step)
        self.event(f"checkpoint {ref.location} ({seconds:.1f} s)")

    def passkey(self, report: PasskeyReport) -> None:
        self.run_dir.record_passkey(report)
        self.event(passkey_summary(report))

    def task_results(self, files: dict[str, str], *, step: int | None = None) -> None:
        """The job's lm_eval task evaluation: its files under ``RUN/eval`` (after training)
        or ``RUN/eval/step_<step>`` (at an interval checkpoint), each cell's score in
        Prometheus, and an event with the scores."""
        directory = self.run_dir.record_task_evaluation(files, step=step)
        results = json.loads(files.get("results.json") or "{}")
        cells = results.get("cells", [])
        if self.metrics is not None:
            for cell in cells:
                self.metrics.task_score(task=cell["task"], length=cell["length"],
                                        score=cell["score"])
        scores = "; ".join(f"{c['task']} @ {c['length']}: {100 * c['score']:.1f} "
                           f"({c['samples']} samples)" for c in cells)
        self.event(f"lm_eval tasks: {scores or 'no cell ran'} ({directory})")
        for line in results.get("skipped", []):
            self.event(line)

    # ----------------------------------------------------------------- faults
    def flight_recorder(self, directory: Path, dumps: dict[int, WorkerDump], *, ranks: int,
                        waited_seconds: float, what: str) -> str:
        """A hang's evidence (:mod:`.flight_recorder`): write each rank's recorder (torch's
        pickle, as its worker handed it over) to ``directory/rank_<r>`` and its threads'
        stacks to ``stacks_<r>.txt``, then one event naming them, what each rank waits for,
        NCCL's own dumps found there and the ranks that did not answer among the ``ranks``
        asked; returns the event's line. A file that cannot be written is said in an event,
        not raised: the recovery goes on either way."""
        saved = True
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for rank, dump in dumps.items():
                if dump.recorder is not None:
                    (directory / f"{DUMP_PREFIX}{rank}").write_bytes(dump.recorder)
                (directory / f"{STACKS_PREFIX}{rank}.txt").write_text(dump.stacks)
        except OSError as exc:
            saved = False
            self.event(f"flight recorder: cannot write {directory} ({exc.strerror})", exc=exc)
        line = dump_summary(directory, dumps, ranks=ranks, waited_seconds=waited_seconds,
                            what=what, saved=saved)
        self.event(line)
        return line

    def restart(self, failure: Failure, *, failed_at_step: int, world_size: int,
                failures_used: int) -> None:
        if self.metrics is not None:
            self.metrics.restart(failure.kind.value)
        with self._lock:
            self._failures_used = failures_used
            self._restarts.append(Restart(
                reason=failure.kind.value, detail=failure.detail, detected_at=time.time(),
                failed_at_step=failed_at_step, world_size_before=world_size))
            self._awaiting_first_step = len(self._restarts) - 1

    def resized(self) -> None:
        if self.metrics is not None:
            self.metrics.resized()
        with self._lock:
            self._resizes += 1

    def torn_down(self) -> None:
        if self.metrics is not None:
            self.metrics.stopped()

    # ----------------------------------------------------------------- the status
    def status(self) -> JobStatus:
        with self._lock:
            plan = self._plan
            return JobStatus(
                job_name=self.job.name, state=self._state.value, step=self._step,
                total_steps=self.job.train.train.steps, dp=plan.dp if plan else 0,
                target_dp=self.job.dp_max, cp=self.job.cp, restarts=tuple(self._restarts),
                failures_used=self._failures_used, resizes=self._resizes,
                last_stats=self._last_stats, last_checkpoint_step=self._last_checkpoint_step,
                workers=self._workers, plan=plan, error=self._error,
                events=tuple(self._events), metrics_url=self.metrics_url,
                replica_groups=self.job.replicas, replica_losses=tuple(self._replica_losses),
                nonfinite_skipped=self._nonfinite_skipped,
            )


def passkey_summary(report: PasskeyReport) -> str:
    """The evaluation in one line: exact match (overall, as a count of prompts, and per
    length), then per-digit accuracy against chance, e.g. ``passkey: exact match 1.00 (6/6
    prompts; 4096: 1.00), per-digit accuracy 1.000 (chance: exact 1e-05, per digit 0.1)``."""
    matched = sum(cell.exact_matches for cell in report.cells)
    prompts = sum(cell.samples for cell in report.cells)
    lengths = ", ".join(f"{n}: {report.length_accuracy(n):.2f}" for n in report.lengths)
    digits = report.format_table().splitlines()[-1]
    return (f"passkey: exact match {report.accuracy:.2f} ({matched}/{prompts} prompts; "
            f"{lengths}), {digits}")
