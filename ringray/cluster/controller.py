"""The job controller: one Ray actor per job that places, starts, drives and heals its rings.

    controller = start_controller(train_options, cluster_options)   # see ringray.cluster.launch
    controller.status.remote()       # a JobStatus, any time
    controller.stop.remote()         # checkpoint at the next step boundary and stop

The controller is an explicit state machine; each state has one handler that does its work
and returns the next state::

    placing ─► starting ─► running ⇄ checkpointing ─► evaluating ─► finished
       ▲           │          │            │
       │           ▼          ▼            ▼
       └──── recovering ◄─────┴────────────┘      (also: resizing ─► placing; failed; stopped)

It watches for a worker's death (its calls fail), a node's death (the GCS marks it dead), a
preemption notice (the node is draining: checkpoint first when the deadline leaves time) and
a hang (no step within the step timeout). On any of them it kills *every* worker of the job
(a survivor would otherwise sit in a collective waiting for its dead peer), re-plans on the
live nodes, restores the last complete checkpoint and continues. What to do is decided by the
pure policies of :mod:`ringray.cluster.policy`; this module carries the decisions out.

The state machine runs on a thread of its own inside the actor, so it does not depend on the
caller: the actor is detached and named after the job, and a new ``ringray train`` reattaches.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ringray.cluster.nodes import (
    NODE_ID_LABEL,
    draining_nodes,
    node_liveness,
    schedulable_nodes,
)
from ringray.cluster.options import ClusterOptions
from ringray.cluster.placement import (
    LinkBandwidths,
    PlacementError,
    PlacementPlan,
    plan_placement,
    verify_placement,
)
from ringray.cluster.policy import (
    CheckpointFirst,
    Failure,
    FailureKind,
    GiveUp,
    dp_options,
    grow_to,
    on_drain,
    on_failure,
    track_larger_capacity,
)
from ringray.cluster.worker import TrainWorker, WorkerHealth
from ringray.train import CheckpointRef, StepStats, TrainOptions
from ringray.train.loop import StepsLog

# How long a probed worker may take to answer before a hang report calls it unresponsive.
_PROBE_SECONDS = 2.0
_EVENTS_KEPT = 100
# The ranks' collectives time out well after the controller's step timeout, so a hang is
# seen (and reported) by the controller, not as a survivor's collective error.
_COLLECTIVE_TIMEOUT_FACTOR = 2


class JobState(str, Enum):
    PLACING = "placing"
    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    EVALUATING = "evaluating"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


TERMINAL_STATES = frozenset({JobState.FINISHED, JobState.FAILED, JobState.STOPPED})


@dataclass(frozen=True, kw_only=True)
class Event:
    time: float  # wall-clock seconds
    state: str
    message: str


@dataclass(frozen=True, kw_only=True)
class Restart:
    """One recovery: what happened and what it cost."""

    reason: str  # a FailureKind value
    detail: str
    detected_at: float  # wall-clock seconds
    failed_at_step: int  # steps completed when the failure was seen
    resumed_from_step: int | None = None  # the checkpoint restored (None: none yet)
    lost_steps: int | None = None  # steps done again: failed_at_step - resumed_from_step
    recovery_seconds: float | None = None  # detection → first completed step afterwards
    world_size_before: int = 0
    world_size_after: int | None = None


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    job_name: str
    state: str
    step: int
    total_steps: int
    dp: int  # data-parallel degree of the current (or last) placement; 0 before the first
    target_dp: int
    cp: int
    restarts: tuple[Restart, ...]
    failures_used: int  # restarts that count against max_failures
    resizes: int  # grows at a checkpoint boundary
    last_stats: StepStats | None
    last_checkpoint_step: int | None
    workers: tuple[WorkerHealth, ...]  # where each rank runs, as probed at start
    plan: PlacementPlan | None  # the current (or last) placement
    error: str | None
    events: tuple[Event, ...]

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def done(self) -> bool:
        return JobState(self.state) in TERMINAL_STATES


class _Timeout(Exception):
    """An awaited call did not finish in time (a hang, or a startup that never completes)."""


class JobController:
    """The actor class; :func:`ringray.cluster.launch.start_controller` creates it."""

    def __init__(self, train: TrainOptions, cluster: ClusterOptions) -> None:
        self.train = train
        self.cluster = cluster
        self.run_dir = Path(train.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.steps_log = StepsLog(self.run_dir / "steps.jsonl")
        self._lock = threading.Lock()
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        # What the machine knows; changed only by the machine's thread.
        self._state = JobState.PLACING
        self._plan: PlacementPlan | None = None
        self._pg = None
        self._workers: list = []
        self._worker_health: tuple[WorkerHealth, ...] = ()
        self._watched_nodes: tuple[str, ...] = ()  # node of each rank while workers exist
        self._watched_at = 0.0  # when nodes and drains were last checked between steps
        self._step = 0
        self._last_stats: StepStats | None = None
        self._restore: CheckpointRef | None = None  # the checkpoint a (re)start restores
        self._restore_decided = False
        self._saved_steps: set[int] = set()  # checkpoints this job wrote
        self._checkpoint_seconds: float | None = None
        self._restarts: list[Restart] = []
        self._failures_used = 0
        self._resizes = 0
        self._pending_failure: Failure | None = None
        self._after_checkpoint: JobState | None = None
        self._drain: tuple[tuple[str, ...], float | None] | None = None
        self._avoid: set[str] = set()
        self._capacity_wait_since: float | None = None
        self._larger_since: float | None = None
        self._recovering_from: int | None = None  # index into _restarts awaiting a first step
        self._error: str | None = None
        self._events: list[Event] = []
        self._handlers: dict[JobState, Callable[[], JobState]] = {
            JobState.PLACING: self._place,
            JobState.STARTING: self._start,
            JobState.RUNNING: self._run,
            JobState.CHECKPOINTING: self._checkpoint,
            JobState.EVALUATING: self._evaluate,
            JobState.RECOVERING: self._recover,
            JobState.RESIZING: self._resize,
        }

    # ----------------------------------------------------------------- actor API
    def start(self) -> None:
        """Start the state machine (once; later calls do nothing)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="ringray-job",
                                                 daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Checkpoint at the next step boundary, then stop."""
        self._stop_requested.set()

    def status(self) -> JobStatus:
        with self._lock:
            plan = self._plan
            return JobStatus(
                job_name=self.cluster.job_name, state=self._state.value, step=self._step,
                total_steps=self.train.steps, dp=plan.dp if plan else 0,
                target_dp=self.cluster.dp_max, cp=self.cluster.cp,
                restarts=tuple(self._restarts), failures_used=self._failures_used,
                resizes=self._resizes, last_stats=self._last_stats,
                last_checkpoint_step=max(self._saved_steps) if self._saved_steps else (
                    self._restore.step if self._restore else None),
                workers=self._worker_health, plan=plan,
                error=self._error, events=tuple(self._events[-_EVENTS_KEPT:]),
            )

    def wait(self, timeout_seconds: float) -> JobStatus:
        """The status once the job has ended, or after ``timeout_seconds``."""
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        return self.status()

    # ----------------------------------------------------------------- the machine
    def _main(self) -> None:
        state = JobState.PLACING
        try:
            while state not in TERMINAL_STATES:
                self._set_state(state)
                state = self._handlers[state]()
        except Exception as exc:  # a controller bug: report it rather than leave a job hanging
            self._error = f"controller error: {type(exc).__name__}: {exc}"
            state = JobState.FAILED
        finally:
            self._teardown()
            if self.cluster.request_resources:
                _request_resources([])
        if self._error:
            self._log(self._error)
        self._set_state(state)

    def _set_state(self, state: JobState) -> None:
        with self._lock:
            changed = state is not self._state
            self._state = state
        if changed:
            self._log(f"state: {state.value}")

    def _log(self, message: str) -> None:
        event = Event(time=time.time(), state=self._state.value, message=message)
        with self._lock:
            self._events.append(event)
            del self._events[:-_EVENTS_KEPT]
        with (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps({"time": event.time, "state": event.state,
                                "message": message}) + "\n")

    # ----------------------------------------------------------------- placing
    def _place(self) -> JobState:
        cluster, train = self.cluster, self.train
        options = dp_options(dp_min=cluster.dp_min, dp_max=cluster.dp_max,
                             global_batch=train.global_batch)
        try:
            plan = self._plan_on_live_nodes(options)
        except PlacementError as exc:
            return self._wait_for_capacity(str(exc))
        self._capacity_wait_since = None
        if plan.dp < cluster.dp_max:
            self._log(f"running at dp={plan.dp} of {cluster.dp_max}: the live nodes have room "
                      f"for no more; asking the autoscaler for the full size")
            self._ask_for_full_size()
        with self._lock:
            self._plan = plan
        self._log(plan.describe())
        return JobState.STARTING

    def _plan_on_live_nodes(self, options: tuple[int, ...]) -> PlacementPlan:
        nodes = schedulable_nodes(worker_resources=self.cluster.worker_resources,
                                  avoid=self._avoid)
        bandwidths = LinkBandwidths(**{
            name: value for name, value in (
                ("intra_node_gbps", self.cluster.intra_node_gbps),
                ("inter_node_gbps", self.cluster.inter_node_gbps),
            ) if value is not None
        })
        return plan_placement(
            nodes, cp=self.cluster.cp, dp_options=options,
            failure_domain=self.cluster.failure_domain, bandwidths=bandwidths,
            kv_block_bytes=self._kv_block_bytes(),
        )

    def _kv_block_bytes(self) -> int:
        """Bytes of the K/V block one rank passes per layer and ring step, at the target dp."""
        model, train = self.train.model, self.train
        element = 2 if self.cluster.accelerator == "gpu" else 4
        local_batch = max(1, train.global_batch // self.cluster.dp_max)
        head_dim = model.dim // model.n_heads
        return 2 * local_batch * (train.seq_len // self.cluster.cp) * model.n_kv_heads \
            * head_dim * element

    def _wait_for_capacity(self, why: str) -> JobState:
        now = time.monotonic()
        if self._capacity_wait_since is None:
            self._capacity_wait_since = now
            self._log(f"waiting for capacity: {why}")
            self._ask_for_full_size()
        if now - self._capacity_wait_since > self.cluster.capacity_wait_seconds:
            self._error = (f"{why} (waited {self.cluster.capacity_wait_seconds:.0f} s, "
                           f"cluster.capacity_wait_seconds)")
            return JobState.FAILED
        time.sleep(self.cluster.poll_seconds)
        return JobState.PLACING

    def _ask_for_full_size(self) -> None:
        if self.cluster.request_resources:
            world = self.cluster.dp_max * self.cluster.cp
            _request_resources([dict(self.cluster.worker_resources)] * world)

    # ----------------------------------------------------------------- starting
    def _start(self) -> JobState:
        plan = self._plan
        assert plan is not None
        try:
            self._create_workers(plan)
            healths = self._await([w.health.remote() for w in self._workers],
                                  timeout=self.cluster.startup_timeout_seconds)
            verify_placement(plan, [h.node_id for h in healths])
            self._watched_nodes = tuple(h.node_id for h in healths)
            with self._lock:
                self._worker_health = tuple(healths)
            host, port = self._await([self._workers[0].rendezvous_address.remote()],
                                     timeout=self.cluster.startup_timeout_seconds)[0]
            self._await(
                [w.join.remote(host=host, port=port,
                               backend=self.cluster.process_group_backend,
                               timeout_seconds=_COLLECTIVE_TIMEOUT_FACTOR
                               * self.cluster.step_timeout_seconds)
                 for w in self._workers],
                timeout=self.cluster.startup_timeout_seconds,
            )
            restore = self._restore_point()
            options = replace(self.train, dp=plan.dp, cp=plan.cp)
            steps = self._await([w.build.remote(options, restore) for w in self._workers],
                                timeout=self.cluster.startup_timeout_seconds)
        except _FailureSeen as seen:
            return self._fail_over(seen.failure)
        except _Timeout as exc:
            return self._fail_over(Failure(kind=FailureKind.STARTUP, detail=str(exc)))
        except _Fatal as exc:
            self._error = str(exc)
            return JobState.FAILED
        except PlacementError as exc:
            self._error = f"workers did not land where planned: {exc}"
            return JobState.FAILED
        self._step = steps[0]
        self.steps_log.truncate(self._step)
        self._larger_since = None
        self._log(f"started {plan.world_size} workers (dp={plan.dp} × cp={plan.cp}) "
                  f"at step {self._step}"
                  + (f", restored {restore.location}" if restore else ""))
        if self._recovering_from is not None:
            restart = self._restarts[self._recovering_from]
            resumed = restore.step if restore else 0
            self._restarts[self._recovering_from] = replace(
                restart, resumed_from_step=resumed,
                lost_steps=restart.failed_at_step - resumed, world_size_after=plan.world_size,
            )
        return JobState.RUNNING

    def _create_workers(self, plan: PlacementPlan) -> None:
        self._watched_nodes = tuple(rank.node_id for rank in plan.ranks)
        bundles = [dict(self.cluster.worker_resources) for _ in plan.ranks]
        selectors = [{NODE_ID_LABEL: rank.node_id} for rank in plan.ranks]
        self._pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors,
                                   name=f"ringray-{self.cluster.job_name}")
        self._await([self._pg.ready()], timeout=self.cluster.startup_timeout_seconds,
                    what="the placement group to be reserved")
        actor = ray.remote(TrainWorker)
        resources = self.cluster.actor_resources()
        with self._lock:
            self._worker_health = ()  # the new workers are probed once they are up
        self._workers = [
            actor.options(
                max_concurrency=2,  # health() answers while a step runs
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank.rank,
                ),
                **resources,
            ).remote(rank=rank.rank, world_size=plan.world_size)
            for rank in plan.ranks
        ]

    def _restore_point(self) -> CheckpointRef | None:
        """The newest complete checkpoint this job may restore: at the first start, the
        newest there is when ``train.resume`` allows it; after that, one this job wrote."""
        latest = self._await(
            [self._workers[0].latest_checkpoint.remote(self.train.checkpoint_location)],
            timeout=self.cluster.startup_timeout_seconds,
        )[0]
        if not self._restore_decided:
            self._restore_decided = True
            self._restore = latest if self.train.resume else None
        elif latest is not None and latest.step in self._saved_steps:
            self._restore = latest
        return self._restore

    # ----------------------------------------------------------------- running
    def _run(self) -> JobState:
        if self._drain is not None:
            nodes, seconds_left = self._drain
            decision = on_drain(
                seconds_left=seconds_left,
                step_seconds=self._last_stats.step_seconds if self._last_stats else None,
                checkpoint_seconds=self._checkpoint_seconds,
            )
            failure = Failure(kind=FailureKind.PREEMPTED, nodes=nodes,
                              detail=f"node(s) {_short(nodes)} draining")
            self._drain = None
            if isinstance(decision, CheckpointFirst):
                self._log(f"{failure.detail}: checkpointing before moving")
                self._pending_failure = failure
                self._after_checkpoint = JobState.RECOVERING
                return JobState.CHECKPOINTING
            return self._fail_over(replace(failure, detail=f"{failure.detail}; {decision.why}"))
        if self._stop_requested.is_set():
            if self._saved_steps and max(self._saved_steps) == self._step:
                return JobState.STOPPED
            self._after_checkpoint = JobState.STOPPED
            return JobState.CHECKPOINTING
        if self._step >= self.train.steps:
            return JobState.EVALUATING
        try:
            if time.monotonic() - self._watched_at >= self.cluster.poll_seconds:
                # Steps shorter than a poll finish before _await looks: look between them.
                self._watched_at = time.monotonic()
                self._check_nodes()
                self._check_drains()
                if self._drain is not None:
                    return JobState.RUNNING
            stats = self._await([w.run_steps.remote(1) for w in self._workers],
                                timeout=self.cluster.step_timeout_seconds,
                                what="a step", watch_drains=True)[0][-1]
        except _FailureSeen as seen:
            return self._fail_over(seen.failure)
        except _Timeout as exc:
            return self._fail_over(Failure(kind=FailureKind.HANG,
                                           detail=f"{exc}; {self._probe()}"))
        self._record_step(stats)
        interval = self.train.checkpoint_interval
        if (interval and stats.step % interval == 0) or stats.step >= self.train.steps:
            return JobState.CHECKPOINTING
        return JobState.RUNNING

    def _record_step(self, stats: StepStats) -> None:
        self.steps_log.append(stats)
        recovered = None
        with self._lock:
            self._step, self._last_stats = stats.step, stats
            if self._recovering_from is not None:  # the first step since a recovery
                index, self._recovering_from = self._recovering_from, None
                recovered = self._restarts[index] = replace(
                    self._restarts[index], recovery_seconds=time.time() -
                    self._restarts[index].detected_at,
                )
        if recovered is not None:
            self._log(f"recovered from {recovered.reason} in {recovered.recovery_seconds:.1f} s "
                      f"(to the first step done); {recovered.lost_steps} step(s) redone")
        if self._plan is not None and self._plan.dp < self.cluster.dp_max:
            self._larger_since = track_larger_capacity(
                self._larger_since, current_dp=self._plan.dp,
                feasible_dp=self._feasible_dp(), now=time.monotonic(),
            )

    def _feasible_dp(self) -> int:
        options = dp_options(dp_min=self.cluster.dp_min, dp_max=self.cluster.dp_max,
                             global_batch=self.train.global_batch)
        try:
            return self._plan_on_live_nodes(options).dp
        except PlacementError:
            return 0

    # ----------------------------------------------------------------- checkpointing
    def _checkpoint(self) -> JobState:
        started = time.monotonic()
        try:
            ref = self._await([w.checkpoint.remote() for w in self._workers],
                              timeout=self.cluster.step_timeout_seconds,
                              what="a checkpoint")[0]
        except _FailureSeen as seen:
            return self._fail_over(seen.failure)
        except _Timeout as exc:
            return self._fail_over(Failure(kind=FailureKind.HANG,
                                           detail=f"{exc}; {self._probe()}"))
        with self._lock:
            self._checkpoint_seconds = time.monotonic() - started
            self._saved_steps.add(ref.step)
            self._restore = ref
        self._log(f"checkpoint {ref.location} ({self._checkpoint_seconds:.1f} s)")
        follow_up, self._after_checkpoint = self._after_checkpoint, None
        if follow_up is JobState.RECOVERING:
            failure, self._pending_failure = self._pending_failure, None
            return self._fail_over(failure)
        if follow_up is not None:
            return follow_up
        if self._step >= self.train.steps:
            return JobState.EVALUATING
        grow = grow_to(
            current_dp=self._plan.dp, feasible_dp=self._feasible_dp(),
            larger_since=self._larger_since, now=time.monotonic(),
            grow_after_seconds=self.cluster.grow_after_seconds,
        ) if self._plan.dp < self.cluster.dp_max else None
        if grow is not None:
            self._log(f"growing from dp={self._plan.dp} to dp={grow} at step {self._step}")
            return JobState.RESIZING
        return JobState.RUNNING

    def _evaluate(self) -> JobState:
        passkey = self.train.passkey
        if passkey.lengths:
            cells = len(passkey.lengths) * len(passkey.depths) * passkey.samples_per_cell
            self._log(f"passkey retrieval at lengths {list(passkey.lengths)}")
            try:
                report = self._await(
                    [w.evaluate_passkey.remote() for w in self._workers],
                    timeout=self.cluster.step_timeout_seconds * max(1, math.ceil(cells / 8)),
                    what="the passkey evaluation",
                )[0]
            except _FailureSeen as seen:
                return self._fail_over(seen.failure)
            except _Timeout as exc:
                return self._fail_over(Failure(kind=FailureKind.HANG, detail=str(exc)))
            (self.run_dir / "passkey.json").write_text(json.dumps(report.to_dict(), indent=2))
            self._log("passkey: " + " ".join(report.format_table().splitlines()[-1:]))
        return JobState.FINISHED

    # ----------------------------------------------------------------- recovering, resizing
    def _fail_over(self, failure: Failure) -> JobState:
        self._pending_failure = failure
        return JobState.RECOVERING

    def _recover(self) -> JobState:
        failure, self._pending_failure = self._pending_failure, None
        assert failure is not None
        decision = on_failure(failure, restarts=self._failures_used,
                              max_failures=self.cluster.max_failures)
        world = self._plan.world_size if self._plan and self._workers else 0
        self._log(f"{failure.kind.value}: {failure.detail}")
        self._teardown()
        if isinstance(decision, GiveUp):
            self._error = decision.reason
            return JobState.FAILED
        with self._lock:
            if decision.counts_as_failure:
                self._failures_used += 1
            self._avoid.update(decision.avoid_nodes)
            self._restarts.append(Restart(
                reason=failure.kind.value, detail=failure.detail, detected_at=time.time(),
                failed_at_step=self._step, world_size_before=world,
            ))
            self._recovering_from = len(self._restarts) - 1
        return JobState.PLACING

    def _resize(self) -> JobState:
        self._teardown()
        with self._lock:
            self._resizes += 1
        return JobState.PLACING

    def _teardown(self) -> None:
        """Kill every worker and release the placement group."""
        for worker in self._workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already dead: nothing to kill
                pass
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # already removed, or its node is gone
                pass
        self._watched_nodes = ()
        with self._lock:  # _worker_health stays: the status shows where the job last ran
            self._workers, self._pg = [], None

    # ----------------------------------------------------------------- watching
    def _await(self, refs: list, *, timeout: float, what: str = "workers to start",
               watch_drains: bool = False) -> list:
        """The results of ``refs`` (in order), watching the job's workers while waiting.

        Raises:
            _FailureSeen: a worker died, its node died, or a call raised; with
                ``watch_drains``, a drain whose deadline leaves no time for a checkpoint.
            _Fatal: a call raised ``ValueError`` (the job's options are wrong: retrying
                cannot help).
            _Timeout: not all results within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: dict = {}
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs),
                                      timeout=self.cluster.poll_seconds)
            for ref in ready:
                if ref not in results:
                    results[ref] = self._result(ref, rank_of[ref])
            if not pending:
                return [results[ref] for ref in refs]
            self._check_nodes()
            if watch_drains:
                self._check_drains()
            if time.monotonic() > deadline:
                late = [rank_of[ref] for ref in pending]
                raise _Timeout(f"no answer from rank(s) {_ranks(late)} within {timeout:.0f} s "
                               f"while waiting for {what}")

    def _result(self, ref, rank: int):
        try:
            return ray.get(ref)
        except ActorUnavailableError:
            raise _FailureSeen(self._settle_lost_contact(rank)) from None
        except RayActorError as exc:
            raise _FailureSeen(self._actor_death(rank, exc)) from None
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            if isinstance(cause, ValueError):
                raise _Fatal(f"rank {rank}: {cause}") from None
            # A collective broken by a dead peer also lands here: if a worker or node died,
            # report that instead (it is the cause).
            time.sleep(self.cluster.poll_seconds)
            self._check_nodes()
            self._check_workers_alive()
            silent = self._silent_ranks()
            if silent:  # a peer stopped inside a step: the collective timed out waiting on it
                raise _FailureSeen(Failure(
                    kind=FailureKind.HANG,
                    detail=f"rank {rank}: {_first_line(cause or exc)}; rank(s) "
                    f"{_ranks(silent)} do not answer a health probe",
                )) from None
            raise _FailureSeen(Failure(
                kind=FailureKind.WORKER_ERROR,
                detail=f"rank {rank}: {_first_line(cause or exc)}",
            )) from None

    def _worker_nodes(self) -> dict[str, list[int]]:
        """The nodes holding this job's ranks: planned ones from the moment their placement
        group is asked for, probed ones once the workers answer; none after a teardown."""
        nodes: dict[str, list[int]] = {}
        for rank, node in enumerate(self._watched_nodes):
            nodes.setdefault(node, []).append(rank)
        return nodes

    def _actor_death(self, rank: int, exc: RayActorError) -> Failure:
        """A dead worker, counted under its cause: the GCS may report the actors of a dead
        node before its node table says so, but it names the node in the actor's death."""
        self._check_nodes()
        node = _DEAD_NODE_IN_ACTOR_DEATH.search(str(exc))
        if node is not None:
            return Failure(kind=FailureKind.NODE_DIED, nodes=(node.group(1),),
                           detail=f"node(s) {node.group(1)[:8]} died, taking rank {rank}")
        return Failure(kind=FailureKind.ACTOR_DIED,
                       detail=f"rank {rank} died ({_death_reason(exc)})")

    def _settle_lost_contact(self, rank: int) -> Failure:
        """Why the connection to ``rank`` dropped. Ray cannot say yet: either the worker's
        process died (its raylet reports that within a moment) or its whole node did (seen
        once the GCS health checks give up on it). Wait until one of them is known, so the
        next placement leaves a dead node out and the restart is counted under its cause."""
        deadline = time.monotonic() + self.cluster.startup_timeout_seconds
        while time.monotonic() < deadline:
            self._check_nodes()  # raises for a dead node
            try:
                ray.get(self._workers[rank].health.remote(), timeout=self.cluster.poll_seconds)
            except ActorDiedError as exc:
                return self._actor_death(rank, exc)
            except (ActorUnavailableError, GetTimeoutError):
                continue
            return Failure(kind=FailureKind.WORKER_ERROR,
                           detail=f"rank {rank}: a call was lost (the worker still answers)")
        return Failure(kind=FailureKind.ACTOR_DIED,
                       detail=f"rank {rank} unreachable for "
                       f"{self.cluster.startup_timeout_seconds:.0f} s")

    def _check_nodes(self) -> None:
        alive = node_liveness()
        dead = {node: ranks for node, ranks in self._worker_nodes().items()
                if not alive.get(node, False)}
        if dead:
            ranks = sorted(r for rs in dead.values() for r in rs)
            raise _FailureSeen(Failure(
                kind=FailureKind.NODE_DIED, nodes=tuple(sorted(dead)),
                detail=f"node(s) {_short(dead)} died, taking rank(s) {_ranks(ranks)}",
            ))

    def _check_workers_alive(self) -> None:
        probes = [w.health.remote() for w in self._workers]
        for rank, probe in enumerate(probes):
            try:
                ray.get(probe, timeout=_PROBE_SECONDS)
            except ActorUnavailableError:
                raise _FailureSeen(self._settle_lost_contact(rank)) from None
            except RayActorError as exc:
                raise _FailureSeen(self._actor_death(rank, exc)) from None
            except GetTimeoutError:
                pass

    def _check_drains(self) -> None:
        ours = self._worker_nodes()
        draining = {node: left for node, left in draining_nodes().items() if node in ours}
        if not draining or self._drain is not None:
            return
        lefts = [left for left in draining.values() if left is not None]
        seconds_left = min(lefts) if lefts else None
        self._drain = (tuple(sorted(draining)), seconds_left)
        self._log(f"node(s) {_short(draining)} draining"
                  + (f", {seconds_left:.0f} s to the deadline" if seconds_left else ""))
        decision = on_drain(
            seconds_left=seconds_left,
            step_seconds=self._last_stats.step_seconds if self._last_stats else None,
            checkpoint_seconds=self._checkpoint_seconds,
        )
        if not isinstance(decision, CheckpointFirst):
            self._drain = None
            raise _FailureSeen(Failure(kind=FailureKind.PREEMPTED, nodes=tuple(sorted(draining)),
                                       detail=f"node(s) {_short(draining)} draining; "
                                       f"{decision.why}"))

    def _silent_ranks(self) -> list[int]:
        """Ranks that do not answer a health probe within a couple of seconds."""
        probes = [w.health.remote() for w in self._workers]
        silent = []
        for rank, probe in enumerate(probes):
            try:
                ray.get(probe, timeout=_PROBE_SECONDS)
            except Exception:
                silent.append(rank)
        return silent

    def _probe(self) -> str:
        """Which ranks still answer a health probe (for a hang's report)."""
        silent = self._silent_ranks()
        if not silent:
            return "every rank answers its health probe (stuck in a collective?)"
        return f"rank(s) {_ranks(silent)} do not answer a health probe"


class _FailureSeen(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.detail)
        self.failure = failure


class _Fatal(Exception):
    """A failure that a restart cannot fix (the job's own options are wrong)."""


def _request_resources(bundles: list[dict]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


# How Ray words an actor's death that its node's death caused (gcs_actor_manager).
_DEAD_NODE_IN_ACTOR_DEATH = re.compile(r"because its node has died\. Node Id: ([0-9a-f]+)")


def _death_reason(exc: RayActorError) -> str:
    """The line of an actor's death that says why (Ray puts it after the actor's details)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    because = [line for line in lines if "because" in line]
    return (because or lines or [type(exc).__name__])[0][:200]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _short(nodes) -> str:
    return ", ".join(node[:8] for node in sorted(nodes))


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
