"""The job controller: one Ray actor per job that places, starts, drives and heals its rings.

    controller = start_controller(job_options)   # see ringray.cluster.driver
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
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ringray.cluster.job_options import JobOptions
from ringray.cluster.nodes import NODE_ID_LABEL, schedulable_nodes
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
    MoveNow,
    dp_options,
    grow_to,
    on_drain,
    on_failure,
    track_larger_capacity,
)
from ringray.cluster.status import (
    TERMINAL_STATES,
    Event,
    JobState,
    JobStatus,
    Restart,
    WorkerHealth,
)
from ringray.cluster.watch import CallTimeout, FailureSeen, JobError, RingWatch, short_nodes
from ringray.cluster.worker import TrainWorker
from ringray.metrics.exporter import JobMetrics
from ringray.train import CheckpointRef, StepStats
from ringray.train.loop import StepsLog

_EVENTS_KEPT = 100
# The ranks' collectives time out well after the controller's step timeout, so a hang is
# seen (and reported) by the controller, not as a survivor's collective error.
_COLLECTIVE_TIMEOUT_FACTOR = 2


class JobController:
    """The actor class; :func:`ringray.cluster.driver.start_controller` creates it."""

    def __init__(self, job: JobOptions) -> None:
        self.job = job
        self.train = job.train  # TrainOptions: its sections are the job spec's
        self.cluster = job.cluster
        self.run_dir = Path(job.train.run_dir)
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
        self._watch = RingWatch(poll_seconds=job.cluster.poll_seconds,
                                settle_seconds=job.cluster.startup_timeout_seconds,
                                log=self._log)
        self._worker_health: tuple[WorkerHealth, ...] = ()
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
        self._avoid: set[str] = set()
        self._capacity_wait_since: float | None = None
        self._larger_since: float | None = None
        self._recovering_from: int | None = None  # index into _restarts awaiting a first step
        self._error: str | None = None
        self._events: list[Event] = []
        self._metrics = JobMetrics(job.name)
        self._metrics.target(job.dp_max * job.cp)
        self._metrics.state(self._state.value)
        self._metrics_url = self._serve_metrics()
        self._handlers: dict[JobState, Callable[[], JobState]] = {
            JobState.PLACING: self._place,
            JobState.STARTING: self._start,
            JobState.RUNNING: self._run,
            JobState.CHECKPOINTING: self._checkpoint,
            JobState.EVALUATING: self._evaluate,
            JobState.RECOVERING: self._recover,
            JobState.RESIZING: self._resize,
        }

    def _serve_metrics(self) -> str | None:
        if self.job.metrics.port is None:
            return None
        address, port = self.job.metrics.address, self.job.metrics.port
        try:
            url = self._metrics.serve(address, port)
        except OSError as exc:  # training matters more than its dashboard: go on without
            self._log(f"metrics: cannot serve on {address}:{port} ({exc.strerror}); set "
                      f"metrics.port to a free port (0: any)")
            return None
        self._log(f"metrics: {url}")
        return url

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
                job_name=self.job.name, state=self._state.value, step=self._step,
                total_steps=self.train.train.steps, dp=plan.dp if plan else 0,
                target_dp=self.job.dp_max, cp=self.job.cp,
                restarts=tuple(self._restarts), failures_used=self._failures_used,
                resizes=self._resizes, last_stats=self._last_stats,
                last_checkpoint_step=max(self._saved_steps) if self._saved_steps else (
                    self._restore.step if self._restore else None),
                workers=self._worker_health, plan=plan,
                error=self._error, events=tuple(self._events[-_EVENTS_KEPT:]),
                metrics_url=self._metrics_url,
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
        self._metrics.state(state.value)
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
        job = self.job
        options = dp_options(dp_min=job.dp_min, dp_max=job.dp_max,
                             global_batch=job.train.train.global_batch)
        try:
            plan = self._plan_on_live_nodes(options)
        except PlacementError as exc:
            return self._wait_for_capacity(str(exc))
        self._capacity_wait_since = None
        if plan.dp < job.dp_max:
            self._log(f"running at dp={plan.dp} of {job.dp_max}: the live nodes have room "
                      f"for no more; asking the autoscaler for the full size")
            self._ask_for_full_size()
        with self._lock:
            self._plan = plan
        self._log(plan.describe())
        return JobState.STARTING

    def _plan_on_live_nodes(self, options: tuple[int, ...]) -> PlacementPlan:
        nodes = schedulable_nodes(worker_resources=self.job.worker_resources,
                                  avoid=self._avoid)
        bandwidths = LinkBandwidths(**{
            name: value for name, value in (
                ("intra_node_gbps", self.cluster.intra_node_gbps),
                ("inter_node_gbps", self.cluster.inter_node_gbps),
            ) if value is not None
        })
        return plan_placement(
            nodes, cp=self.job.cp, dp_options=options,
            failure_domain=self.cluster.failure_domain, bandwidths=bandwidths,
            kv_block_bytes=self._kv_block_bytes(),
        )

    def _kv_block_bytes(self) -> int:
        """Bytes of the K/V block one rank passes per layer and ring step, at the target dp."""
        model, train = self.train.model, self.train.train
        element = 2 if self.cluster.accelerator == "gpu" else 4
        local_batch = max(1, train.global_batch // self.job.dp_max)
        return 2 * local_batch * (train.seq_len // self.job.cp) * model.n_kv_heads \
            * model.head_dim * element

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
            world = self.job.dp_max * self.job.cp
            _request_resources([self.job.worker_resources] * world)

    # ----------------------------------------------------------------- starting
    def _start(self) -> JobState:
        plan = self._plan
        assert plan is not None
        try:
            self._create_workers(plan)
            healths = self._watch.wait([w.health.remote() for w in self._workers],
                                  timeout=self.cluster.startup_timeout_seconds)
            verify_placement(plan, [h.node_id for h in healths])
            self._watch.track(self._workers, tuple(h.node_id for h in healths))
            self._metrics.placed(dp=plan.dp, cp=plan.cp, nodes=[h.node_id for h in healths])
            with self._lock:
                self._worker_health = tuple(healths)
            host, port = self._watch.wait([self._workers[0].rendezvous_address.remote()],
                                     timeout=self.cluster.startup_timeout_seconds)[0]
            self._watch.wait(
                [w.join.remote(host=host, port=port,
                               backend=self.cluster.process_group_backend,
                               timeout_seconds=_COLLECTIVE_TIMEOUT_FACTOR
                               * self.cluster.step_timeout_seconds)
                 for w in self._workers],
                timeout=self.cluster.startup_timeout_seconds,
            )
            restore = self._restore_point()
            options = replace(self.train, parallel=replace(self.train.parallel, dp=plan.dp,
                                                           cp=plan.cp))
            steps = self._watch.wait([w.build.remote(options, restore) for w in self._workers],
                                timeout=self.cluster.startup_timeout_seconds)
        except FailureSeen as seen:
            return self._fail_over(seen.failure)
        except CallTimeout as exc:
            return self._fail_over(Failure(kind=FailureKind.STARTUP, detail=str(exc)))
        except JobError as exc:
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
        # From the moment their placement group is asked for, the planned nodes are watched.
        self._watch.track([], tuple(rank.node_id for rank in plan.ranks))
        bundles = [self.job.worker_resources for _ in plan.ranks]
        selectors = [{NODE_ID_LABEL: rank.node_id} for rank in plan.ranks]
        self._pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors,
                                   name=f"ringray-{self.job.name}")
        self._watch.wait([self._pg.ready()], timeout=self.cluster.startup_timeout_seconds,
                    what="the placement group to be reserved")
        actor = ray.remote(TrainWorker)
        resources = self.job.actor_resources()
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
        self._watch.track(self._workers, self._watch.nodes)

    def _restore_point(self) -> CheckpointRef | None:
        """The newest complete checkpoint this job may restore: at the first start, the
        newest there is when ``train.resume`` allows it; after that, one this job wrote."""
        latest = self._watch.wait(
            [self._workers[0].latest_checkpoint.remote(self.train.checkpoint_location)],
            timeout=self.cluster.startup_timeout_seconds,
        )[0]
        if not self._restore_decided:
            self._restore_decided = True
            self._restore = latest if self.train.checkpoint.resume else None
        elif latest is not None and latest.step in self._saved_steps:
            self._restore = latest
        return self._restore

    # ----------------------------------------------------------------- running
    def _run(self) -> JobState:
        if self._watch.drain is not None:
            nodes, seconds_left = self._watch.drain
            decision = self._drain_decision(seconds_left)
            failure = Failure(kind=FailureKind.PREEMPTED, nodes=nodes,
                              detail=f"node(s) {short_nodes(nodes)} draining")
            self._watch.drain = None
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
        if self._step >= self.train.train.steps:
            return JobState.EVALUATING
        try:
            if time.monotonic() - self._watched_at >= self.cluster.poll_seconds:
                # Steps shorter than a poll finish before wait() looks: look between them,
                # at most once a poll (a GCS query each, so not after every short step).
                self._watched_at = time.monotonic()
                self._watch.check_nodes()
                self._watch.check_drains(self._drain_decision)
                self._track_capacity()
                if self._watch.drain is not None:
                    return JobState.RUNNING
            stats = self._watch.wait([w.run_steps.remote(1) for w in self._workers],
                                timeout=self.cluster.step_timeout_seconds,
                                what="a step", drains=self._drain_decision)[0][-1]
        except FailureSeen as seen:
            return self._fail_over(seen.failure)
        except CallTimeout as exc:
            return self._fail_over(Failure(kind=FailureKind.HANG,
                                           detail=f"{exc}; {self._watch.describe_silence()}"))
        self._record_step(stats)
        interval = self.train.checkpoint.interval
        if (interval and stats.step % interval == 0) or stats.step >= self.train.train.steps:
            return JobState.CHECKPOINTING
        return JobState.RUNNING

    def _record_step(self, stats: StepStats) -> None:
        self.steps_log.append(stats)
        self._metrics.step(stats)
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
            self._metrics.recovered(recovered.recovery_seconds)
            self._log(f"recovered from {recovered.reason} in {recovered.recovery_seconds:.1f} s "
                      f"(to the first step done); {recovered.lost_steps} step(s) redone")

    def _track_capacity(self) -> None:
        """While running smaller than asked, note since when the live nodes hold more."""
        if self._plan is not None and self._plan.dp < self.job.dp_max:
            self._larger_since = track_larger_capacity(
                self._larger_since, current_dp=self._plan.dp,
                feasible_dp=self._feasible_dp(), now=time.monotonic(),
            )

    def _feasible_dp(self) -> int:
        options = dp_options(dp_min=self.job.dp_min, dp_max=self.job.dp_max,
                             global_batch=self.train.train.global_batch)
        try:
            return self._plan_on_live_nodes(options).dp
        except PlacementError:
            return 0

    # ----------------------------------------------------------------- checkpointing
    def _checkpoint(self) -> JobState:
        started = time.monotonic()
        try:
            ref = self._watch.wait([w.checkpoint.remote() for w in self._workers],
                              timeout=self.cluster.step_timeout_seconds,
                              what="a checkpoint")[0]
        except FailureSeen as seen:
            return self._fail_over(seen.failure)
        except CallTimeout as exc:
            return self._fail_over(Failure(kind=FailureKind.HANG,
                                           detail=f"{exc}; {self._watch.describe_silence()}"))
        with self._lock:
            self._checkpoint_seconds = time.monotonic() - started
            self._saved_steps.add(ref.step)
            self._restore = ref
        self._metrics.checkpoint(seconds=self._checkpoint_seconds, step=ref.step)
        self._log(f"checkpoint {ref.location} ({self._checkpoint_seconds:.1f} s)")
        follow_up, self._after_checkpoint = self._after_checkpoint, None
        if follow_up is JobState.RECOVERING:
            failure, self._pending_failure = self._pending_failure, None
            return self._fail_over(failure)
        if follow_up is not None:
            return follow_up
        if self._step >= self.train.train.steps:
            return JobState.EVALUATING
        grow = grow_to(
            current_dp=self._plan.dp, feasible_dp=self._feasible_dp(),
            larger_since=self._larger_since, now=time.monotonic(),
            grow_after_seconds=self.cluster.grow_after_seconds,
        ) if self._plan.dp < self.job.dp_max else None
        if grow is not None:
            self._log(f"growing from dp={self._plan.dp} to dp={grow} at step {self._step}")
            return JobState.RESIZING
        return JobState.RUNNING

    def _evaluate(self) -> JobState:
        passkey = self.train.eval
        if passkey.passkey_lengths:
            cells = (len(passkey.passkey_lengths) * len(passkey.passkey_depths)
                     * passkey.passkey_samples)
            self._log(f"passkey retrieval at lengths {list(passkey.passkey_lengths)}")
            try:
                report = self._watch.wait(
                    [w.evaluate_passkey.remote() for w in self._workers],
                    timeout=self.cluster.step_timeout_seconds * max(1, math.ceil(cells / 8)),
                    what="the passkey evaluation",
                )[0]
            except FailureSeen as seen:
                return self._fail_over(seen.failure)
            except CallTimeout as exc:
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
        self._metrics.restart(failure.kind.value)
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
        self._metrics.resized()
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
        self._watch.forget()
        self._metrics.stopped()
        with self._lock:  # _worker_health stays: the status shows where the job last ran
            self._workers, self._pg = [], None

    def _drain_decision(self, seconds_left: float | None) -> CheckpointFirst | MoveNow:
        return on_drain(
            seconds_left=seconds_left,
            step_seconds=self._last_stats.step_seconds if self._last_stats else None,
            checkpoint_seconds=self._checkpoint_seconds,
        )


def _request_resources(bundles: list[dict]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)
