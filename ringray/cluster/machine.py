"""The job's state machine: one handler per state, each returning the next state (no Ray here).

    machine = JobMachine(job, workers, record, stop_requested=event.is_set)
    state = Placing()
    while not state.terminal:
        state = machine.step(state)

Side effects go through two seams. :class:`WorkerGroup` does everything to the job's workers
(the Ray implementation is :class:`ringray.cluster.worker_group.RayWorkerGroup`, whose actors
each hold a :class:`~ringray.train.session.TrainingSession`; the tests use a fake one and step
the machine one transition at a time), and :class:`~ringray.cluster.record.JobRecord` records
everything (events, steps, metrics, restarts). What to do is decided by the pure policies of
:mod:`ringray.cluster.policy`.

A stop is honoured in every state: training checkpoints first (unless its step is already
saved); a checkpoint in progress is finished; placing, starting, recovering, resizing and an
evaluation end at once. A failure in any state leads to a recovery (or, when a retry cannot
help, to ``Failed`` naming the cause); a failed checkpoint taken for a drain still leads to the
preemption's move, restoring the previous checkpoint, never counted as a fault.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from ringray.cluster.errors import JobError, StopRequested, WorkerGroupFailure
from ringray.cluster.job_options import JobOptions
from ringray.cluster.placement import PlacementError, PlacementPlan
from ringray.cluster.policy import (
    CheckpointFirst,
    Drain,
    Failure,
    FailureKind,
    GiveUp,
    dp_options,
    grow_to,
    on_drain,
    on_failure,
    track_larger_capacity,
)
from ringray.cluster.record import JobRecord
from ringray.cluster.states import (
    Checkpointing,
    Continue,
    Evaluate,
    Evaluating,
    Failed,
    Finished,
    MoveOff,
    Placing,
    Recovering,
    Resizing,
    Running,
    Starting,
    State,
    StopAfter,
    Stopped,
)
from ringray.data import PasskeyReport
from ringray.train import StepStats, TrainOptions
from ringray.train.checkpoint_runs import RunPlan
from ringray.train.policy import evaluation_due, final_checkpoint_due, steps_below_checkpoint
from ringray.train.session import Restored, Saved, checkpoint_due


class WorkerGroup(Protocol):
    """Everything the machine does to the job's workers (every worker's training session, in
    step). Waits raise :class:`WorkerGroupFailure`,
    :class:`JobError`, or (when ``interruptible``) :class:`StopRequested`."""

    def plan(self, dp_choices: tuple[int, ...], *, avoid: frozenset[str]) -> PlacementPlan:
        """The placement on the live nodes (raises ``PlacementError`` when none fits)."""

    def ask_for_full_size(self) -> None:
        """Ask the autoscaler for the job's full size (when the job allows it)."""

    def withdraw_request(self) -> None:
        """The job has ended: its autoscaler request goes (other jobs' stand)."""

    def start(self, plan: PlacementPlan) -> None:
        """Create the workers where ``plan`` puts them and form their process group."""

    def run_plan(self, *, lineage: str | None) -> RunPlan:
        """The run's lineage and restore candidates: at the first start (``lineage`` None),
        per the job's resume options; later, the newest checkpoints of ``lineage``."""

    def build(self, options: TrainOptions, run: RunPlan) -> Restored:
        """Open every worker's training session and restore the newest usable candidate."""

    def step(self, *, move_now: Callable[[Drain], str | None]) -> StepStats:
        """One training step on every rank. A drain seen meanwhile is noted for
        :meth:`take_drain`, or, when ``move_now`` gives a reason, raised at once as a
        preemption."""

    def checkpoint(self) -> Saved:
        """Save and commit the current step (with any warnings from pruning)."""

    def evaluate(self) -> PasskeyReport | None:
        """The passkey evaluation (interruptible by a stop)."""

    def evaluate_tasks(self, step: int) -> dict[str, str] | None:
        """The job's ``eval.tasks`` on checkpoint ``step``, its workers one ring
        (interruptible by a stop): the files written by name, ``None`` with no tasks."""

    def poll(self) -> None:
        """Look at the nodes between steps (raises WorkerGroupFailure for a dead one; notes
        drains)."""

    def take_drain(self) -> Drain | None:
        """A drain notice seen since the last call (then forgotten), or ``None``."""

    def feasible_dp(self, dp_choices: tuple[int, ...], *, avoid: frozenset[str]) -> int:
        """The largest dp the live nodes hold now (0: none)."""

    def teardown(self) -> None:
        """Kill every worker and free their resources (problems are recorded as events)."""

    def close(self) -> None:
        """The job has ended: after the last teardown, release what outlives the workers
        (a replica group's Lighthouse; nothing for one group of workers)."""


class JobMachine:
    """The transitions of one job. Besides the state, it remembers only facts about the run
    (its lineage, the last step saved, the faults used, the nodes to avoid), never what to do
    next: that is the state's."""

    def __init__(
        self,
        job: JobOptions,
        workers: WorkerGroup,
        record: JobRecord,
        *,
        stop_requested: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.job = job
        self.workers = workers
        self.record = record
        self.stop_requested = stop_requested
        self.clock, self.wall_clock, self.sleep = clock, wall_clock, sleep
        self.lineage: str | None = None  # decided at the first start
        self.step_count = 0
        self.saved_step: int | None = None  # the step of the newest committed checkpoint
        self.failures_used = 0
        self.avoid: frozenset[str] = frozenset()
        self.plan: PlacementPlan | None = None
        self.larger_since: float | None = None
        self.last_stats: StepStats | None = None
        self.checkpoint_seconds: float | None = None
        self._polled_at = -math.inf
        self._handlers: dict[type, Callable[[State], State]] = {
            Placing: self._place, Starting: self._start, Running: self._run,
            Checkpointing: self._checkpoint, Evaluating: self._evaluate,
            Recovering: self._recover, Resizing: self._resize,
        }

    @property
    def total_steps(self) -> int:
        return self.job.train.train.steps

    def _dp(self, plan: PlacementPlan) -> int:
        """A plan's data-parallel degree per replica group (its rings are dp_replicate ×
        dp: :mod:`ringray.cluster.replica_groups`)."""
        return plan.dp // self.job.replicas

    def _dp_choices(self) -> tuple[int, ...]:
        return dp_options(dp_min=self.job.dp_min, dp_max=self.job.dp_max,
                          global_batch=self.job.train.train.global_batch)

    # ----------------------------------------------------------------- one transition
    def step(self, state: State) -> State:
        """Run ``state``'s handler (or its stop variant) and return the next state."""
        if state.terminal:
            return state
        if self.stop_requested():
            stopping = self._stopping(state)
            if stopping != state:  # Stopped, or a checkpoint to take first (its own step)
                return stopping
        return self._handlers[type(state)](state)

    def _stopping(self, state: State) -> State:
        """What a stop means in ``state`` (idempotent: a state already stopping stays)."""
        if isinstance(state, Running):
            if self.saved_step == self.step_count:
                return self._stop(f"stopped at step {self.step_count} (its checkpoint is "
                                  f"committed)")
            return Checkpointing(then=StopAfter())
        if isinstance(state, Checkpointing):
            return state if isinstance(state.then, StopAfter) else Checkpointing(then=StopAfter())
        if isinstance(state, Evaluating):
            return self._stop(f"stop requested during the passkey evaluation: abandoned (the "
                              f"final checkpoint, step {self.saved_step}, is committed)")
        where = {Placing: "before the job was placed", Starting: "while the workers started",
                 Recovering: "while recovering", Resizing: "while resizing"}[type(state)]
        saved = (f"; the last committed checkpoint is step {self.saved_step}"
                 if self.saved_step is not None else "")
        return self._stop(f"stopped {where}{saved}")

    def _stop(self, reason: str) -> Stopped:
        self._teardown()
        self.record.event(reason)
        return Stopped(reason=reason)

    def _fail(self, error: str) -> Failed:
        self._teardown()
        return Failed(error=error)

    def _teardown(self) -> None:
        self.workers.teardown()
        self.record.torn_down()

    # ----------------------------------------------------------------- placing
    def _place(self, state: Placing) -> State:
        plan = None
        if state.dp is not None:  # a resize: exactly the degree it decided on, if it still fits
            try:
                plan = self.workers.plan((state.dp,), avoid=self.avoid)
            except PlacementError as exc:
                self.record.event(f"cannot place dp={state.dp} any more ({exc}); placing the "
                                  f"largest dp that fits")
        try:
            plan = plan or self.workers.plan(self._dp_choices(), avoid=self.avoid)
        except PlacementError as exc:
            return self._wait_for_capacity(state, str(exc))
        if self._dp(plan) < self.job.dp_max:
            self.record.event(f"running at dp={self._dp(plan)} of {self.job.dp_max}: the live "
                              f"nodes have room for no more; asking the autoscaler for the full "
                              f"size")
            self.workers.ask_for_full_size()
        self.plan = plan
        self.record.placed(plan)
        return Starting(plan=plan)

    def _wait_for_capacity(self, state: Placing, why: str) -> State:
        now = self.clock()
        since = state.waiting_since
        if since is None:
            since = now
            self.record.event(f"waiting for capacity: {why}")
            self.workers.ask_for_full_size()
        limit = self.job.cluster.capacity_wait_seconds
        if now - since > limit:
            return self._fail(f"{why} (waited {limit:.0f} s, cluster.capacity_wait_seconds)")
        self.sleep(self.job.cluster.poll_seconds)
        return replace(state, waiting_since=since)

    # ----------------------------------------------------------------- starting
    def _start(self, state: Starting) -> State:
        plan = state.plan
        try:
            self.workers.start(plan)
            run = self.workers.run_plan(lineage=self.lineage)
            if self.lineage is None and run.moved_aside_to:
                self.record.moved_aside(run.moved_aside_to)
            self.lineage = run.lineage
            options = replace(self.job.train, parallel=replace(
                self.job.train.parallel, dp=self._dp(plan), cp=plan.cp))
            restored = self.workers.build(options, run)
        except StopRequested:
            return self._stopping(state)
        except WorkerGroupFailure as exc:
            return Recovering(failure=exc.failure)
        except JobError as exc:
            return self._fail(str(exc))
        for why in restored.refused:
            self.record.event(f"refused {why}; falling back to the previous checkpoint")
        refusal = steps_below_checkpoint(self.job.train, restored.checkpoint)
        if refusal is not None:
            return self._fail(refusal)
        self.step_count = restored.step
        self.saved_step = restored.checkpoint.step if restored.checkpoint else None
        self.larger_since = None
        self.record.started(plan, step=restored.step, restored=restored.checkpoint)
        return Running()

    # ----------------------------------------------------------------- running
    def _run(self, state: Running) -> State:
        drain = self.workers.take_drain()
        if drain is not None:
            return self._on_drain(drain)
        if final_checkpoint_due(self.step_count, self.saved_step, self.job.train):
            return Checkpointing(then=Evaluate())
        if self.step_count >= self.total_steps:
            return Evaluating()
        try:
            if self.clock() - self._polled_at >= self.job.cluster.poll_seconds:
                # Steps shorter than a poll finish before a wait looks at the nodes: look
                # between them, at most once a poll (each look is a GCS query).
                self._polled_at = self.clock()
                self.workers.poll()
                self._track_capacity()
                drain = self.workers.take_drain()
                if drain is not None:
                    return self._on_drain(drain)
            stats = self.workers.step(move_now=self._move_now)
        except WorkerGroupFailure as exc:
            return Recovering(failure=exc.failure)
        except JobError as exc:
            return self._fail(str(exc))
        self.step_count, self.last_stats = stats.step, stats
        self.record.step(stats)
        if not checkpoint_due(stats.step, self.job.train):
            return Running()
        return Checkpointing(then=Evaluate() if stats.step >= self.total_steps else Continue())

    def _move_now(self, drain: Drain) -> str | None:
        """Why there is no time to checkpoint before the drain deadline, or ``None``; decided
        with the time left *now* (the deadline is absolute)."""
        decision = on_drain(
            seconds_left=drain.seconds_left(self.wall_clock()),
            step_seconds=self.last_stats.step_seconds if self.last_stats else None,
            checkpoint_seconds=self.checkpoint_seconds,
        )
        return None if isinstance(decision, CheckpointFirst) else decision.why

    def _on_drain(self, drain: Drain) -> State:
        """A preemption notice: checkpoint first when the deadline leaves time, then move."""
        nodes = ", ".join(n[:8] for n in drain.nodes)
        failure = Failure(kind=FailureKind.PREEMPTED, nodes=drain.nodes,
                          detail=f"node(s) {nodes} draining")
        why = self._move_now(drain)
        if why is not None:
            return Recovering(failure=replace(failure, detail=f"{failure.detail}; {why}"))
        if self.saved_step == self.step_count:
            self.record.event(f"{failure.detail}: step {self.step_count} is already "
                              f"checkpointed; moving")
            return Recovering(failure=failure)
        self.record.event(f"{failure.detail}: checkpointing before moving")
        return Checkpointing(then=MoveOff(failure=failure))

    def _track_capacity(self) -> None:
        """While running smaller than asked, note since when the live nodes hold more."""
        if self.plan is not None and self._dp(self.plan) < self.job.dp_max:
            self.larger_since = track_larger_capacity(
                self.larger_since, current_dp=self._dp(self.plan),
                feasible_dp=self.workers.feasible_dp(self._dp_choices(), avoid=self.avoid),
                now=self.clock(),
            )

    # ----------------------------------------------------------------- checkpointing
    def _checkpoint(self, state: Checkpointing) -> State:
        then = state.then
        started = self.clock()
        try:
            saved = self.workers.checkpoint()
        except (WorkerGroupFailure, JobError) as exc:
            return self._checkpoint_failed(then, exc)
        ref = saved.checkpoint
        self.checkpoint_seconds = self.clock() - started
        self.saved_step = ref.step
        self.record.checkpointed(ref, seconds=self.checkpoint_seconds)
        for warning in saved.warnings:
            self.record.event(f"warning: {warning}")
        if isinstance(then, MoveOff):
            return Recovering(failure=then.failure)
        if isinstance(then, StopAfter):
            return self._stop(f"stopped at step {ref.step} (checkpointed)")
        if isinstance(then, Evaluate):
            return Evaluating()
        if self.job.train.eval.tasks_at_checkpoints:
            ended = self._evaluate_tasks(final=False)
            if ended is not None:
                return ended
        return self._after_interval_checkpoint()

    def _checkpoint_failed(self, then: object, exc: WorkerGroupFailure | JobError) -> State:
        why = exc.failure.detail if isinstance(exc, WorkerGroupFailure) else str(exc)
        if isinstance(then, MoveOff):  # the node is going anyway: move, restore the previous
            self.record.event(f"the checkpoint before moving failed ({why}); moving, from the "
                              f"previous checkpoint")
            failure = then.failure
            return Recovering(failure=replace(failure, detail=f"{failure.detail}; its "
                                              f"checkpoint failed: {why}"))
        if isinstance(exc, JobError):  # a full disk, a permission error: not retried
            return self._fail(f"checkpoint failed and will not succeed on a retry: {why}")
        failure = exc.failure
        if failure.kind is FailureKind.WORKER_ERROR:
            failure = replace(failure, kind=FailureKind.CHECKPOINT_FAILED)
        return Recovering(failure=failure)

    def _after_interval_checkpoint(self) -> State:
        if self.plan is None or self._dp(self.plan) >= self.job.dp_max:
            return Running()
        grow = grow_to(
            current_dp=self._dp(self.plan),
            feasible_dp=self.workers.feasible_dp(self._dp_choices(), avoid=self.avoid),
            larger_since=self.larger_since, now=self.clock(),
            grow_after_seconds=self.job.cluster.grow_after_seconds,
        )
        if grow is None:
            return Running()
        self.record.event(f"growing from dp={self._dp(self.plan)} to dp={grow} at step "
                          f"{self.step_count}")
        return Resizing(to_dp=grow)

    # ----------------------------------------------------------------- evaluating
    def _evaluate(self, state: Evaluating) -> State:
        passkey = self.job.train.eval
        if not evaluation_due(self.job.train):
            self._teardown()
            return Finished()
        if passkey.passkey_lengths:
            self.record.event(f"passkey retrieval at lengths {list(passkey.passkey_lengths)}")
            try:
                report = self.workers.evaluate()
            except StopRequested:
                return self._stopping(state)
            except WorkerGroupFailure as exc:
                return Recovering(failure=exc.failure)
            except JobError as exc:
                return self._fail(str(exc))
            if report is not None:
                self.record.passkey(report)
        if passkey.tasks:
            ended = self._evaluate_tasks(final=True)
            if ended is not None:
                return ended
        self._teardown()
        return Finished()

    def _evaluate_tasks(self, *, final: bool) -> State | None:
        """The job's ``eval.tasks`` on the step just checkpointed: ``None`` once their
        results are recorded, else the state a stop, a lost worker or a deterministic error
        leads to (the step's checkpoint is committed either way)."""
        evaluation = self.job.train.eval
        step = self.step_count
        self.record.event(f"lm_eval tasks {', '.join(evaluation.tasks)} at lengths "
                          f"{list(evaluation.task_lengths)}, {evaluation.task_samples} samples "
                          f"each, on step {step}")
        try:
            files = self.workers.evaluate_tasks(step)
        except StopRequested:
            return self._stop(f"stop requested during the task evaluation: abandoned (step "
                              f"{step}'s checkpoint is committed)")
        except WorkerGroupFailure as exc:
            return Recovering(failure=exc.failure)
        except JobError as exc:
            return self._fail(f"the task evaluation at step {step}: {exc}")
        if files is not None:
            self.record.task_results(files, step=None if final else step)
        return None

    # ----------------------------------------------------------------- recovering, resizing
    def _recover(self, state: Recovering) -> State:
        failure = state.failure
        decision = on_failure(failure, restarts=self.failures_used,
                              max_failures=self.job.cluster.max_failures)
        world = self.plan.world_size if self.plan else 0
        self.record.event(f"{failure.kind.value}: {failure.detail}")
        self._teardown()
        if isinstance(decision, GiveUp):
            return Failed(error=decision.reason)
        if decision.counts_as_failure:
            self.failures_used += 1
        self.avoid = self.avoid | frozenset(decision.avoid_nodes)
        self.record.restart(failure, failed_at_step=self.step_count, world_size=world,
                            failures_used=self.failures_used)
        return Placing()

    def _resize(self, state: Resizing) -> State:
        self._teardown()
        self.record.resized()
        return Placing(dp=state.to_dp)
