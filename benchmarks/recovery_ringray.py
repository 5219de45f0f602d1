"""ringray's side of ``benchmarks/recovery.py``: the job under ringray's controller.

**restart** (:func:`run_ringray`): the figures come from the controller's ``Restart``
record: ``detected_at``, ``recovery_seconds`` (detection → the first step afterwards) and
``lost_steps``; "ready" is the controller's ``started …`` event of the restart (every
trainer built and restored).

**replicas** (:func:`run_ringray_replicas`): ``parallel.dp_replicate: 2`` under the same
controller (:class:`ringray.cluster.replica_groups.ReplicatedWorkerGroup`); the figures come
from ``steps.jsonl`` (stamped as its lines appear, :class:`recovery_common.StepsTail`) and
the job's ``events.jsonl``: ``replica group 1 lost (…)`` (detection), ``replica group 1
replaced in X s`` (ready; its start is X s earlier) and ``replica group 1 healed …``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import ray
from recovery_common import (
    LOST_GROUP,
    REPLICAS,
    SLOT_RESOURCE,
    BenchNodes,
    Log,
    RecoveryBenchOptions,
    RecoveryResult,
    StepsTail,
    after_detection,
    bench_train_options,
    replica_figures,
    replica_result,
    tail_done,
    wait_for,
)

from ringray.cluster.driver import release, start_controller
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.status import JobStatus
from ringray.metrics import MetricsOptions


def run_ringray(options: RecoveryBenchOptions, nodes: BenchNodes, work_dir: Path,
                log: Log) -> RecoveryResult:
    """The job under ringray's controller (default detection settings)."""
    job = JobOptions(
        name="recovery-bench",
        train=bench_train_options(options, str(work_dir / "ringray")),
        cluster=ClusterOptions(
            worker_resources={"CPU": 1.0, SLOT_RESOURCE: 1.0},
            max_failures=options.max_failures, request_resources=False,
        ),
        metrics=MetricsOptions(port=None),  # no /metrics endpoint for a benchmark
    )
    log("ringray: starting the job")
    controller, _ = start_controller(job)
    try:
        def reached_kill_step() -> bool:
            status = _status(controller)
            return status.step >= options.kill_after_step or status.done

        def recovered_or_ended() -> bool:
            status = _status(controller)
            return status.done or any(r.recovery_seconds is not None for r in status.restarts)

        if not wait_for(reached_kill_step, timeout=options.start_timeout_seconds):
            return _gave_up(_status(controller), f"step {options.kill_after_step} not reached")
        status = _status(controller)
        if status.done:
            return _gave_up(status, f"ended early: {status.state} ({status.error})")
        log(f"ringray: killing the ring's node at step {status.step}")
        killed_at = nodes.kill_and_replace(nodes.by_id(status.workers[0].node_id))
        recovered = wait_for(recovered_or_ended, timeout=options.recovery_timeout_seconds)
        wait_for(lambda: _status(controller).done,
                 timeout=options.finish_timeout_seconds if recovered else 0)
        return ringray_result(_status(controller), killed_at)
    finally:
        if not _status(controller).done:
            ray.get(controller.stop.remote())
        release(controller)


def _status(controller) -> JobStatus:
    return ray.get(controller.status.remote())


def _gave_up(status: JobStatus, why: str) -> RecoveryResult:
    return RecoveryResult(system="ringray", death_to_first_step_seconds=None,
                          detection_seconds=None, ready_seconds=None, steps_lost=None,
                          restarts=len(status.restarts), final_step=status.step,
                          finished=False, note=why)


def ringray_result(status: JobStatus, killed_at: float) -> RecoveryResult:
    """The figures of the first restart after the kill at ``killed_at``."""
    after = [r for r in status.restarts if r.detected_at >= killed_at]
    finished = status.state == "finished"
    if not after:
        return _gave_up(status, f"no restart recorded; job {status.state}")
    first = after[0]
    recovered_at = (first.detected_at + first.recovery_seconds
                    if first.recovery_seconds is not None else None)
    # The controller's event for a (re)start, logged once every trainer is built and restored.
    ready_at = next((e.time for e in status.events
                     if e.time >= first.detected_at and e.message.startswith("started ")), None)
    note = "" if finished else f"job {status.state}: {status.error}"
    if first.reason != "node_died":
        note = f"restart reason {first.reason}: {first.detail}; {note}".rstrip("; ")
    return RecoveryResult(
        system="ringray",
        death_to_first_step_seconds=None if recovered_at is None else recovered_at - killed_at,
        detection_seconds=first.detected_at - killed_at,
        after_detection_seconds=after_detection(
            None if recovered_at is None else recovered_at - killed_at,
            first.detected_at - killed_at),
        ready_seconds=None if ready_at is None else ready_at - killed_at,
        steps_lost=first.lost_steps,
        restarts=len(status.restarts),
        final_step=status.step,
        finished=finished,
        note=note,
    )


# --------------------------------------------------------------------- replicas
SYSTEM_REPLICAS = "ringray, no standby"  # cluster.replica_standby: false
SYSTEM_STANDBY = "ringray (default: standby)"  # the default keeps a standby on the spare node
REPLACED = re.compile(
    rf"^replica group {LOST_GROUP} replaced(?: by the standby group)? in ([0-9.]+) s")


def run_ringray_replicas(options: RecoveryBenchOptions, nodes: BenchNodes, work_dir: Path,
                         log: Log, *, standby: bool = False) -> RecoveryResult:
    """Two replica groups (a CP=2 ring each, a node each, a spare node); group 1's node is
    killed, no node added. ``standby``: the default configuration, in which the spare node
    holds a standby group's workers, started ahead (``cluster.replica_standby`` unset);
    without it, ``replica_standby: false`` (the replacement starts its processes then)."""
    system = SYSTEM_STANDBY if standby else SYSTEM_REPLICAS
    run_dir = work_dir / ("ringray-standby" if standby else "ringray-replicas")
    job = JobOptions(
        name="recovery-bench-standby" if standby else "recovery-bench-replicas",
        train=bench_train_options(options, str(run_dir), replicas=REPLICAS),
        cluster=ClusterOptions(
            worker_resources={"CPU": 1.0, SLOT_RESOURCE: 1.0},
            max_failures=options.max_failures, request_resources=False,
            failure_domain=None,  # the bench's nodes have no zone labels
            replica_heartbeat_seconds=options.replica_heartbeat_seconds,
            replica_standby=None if standby else False,
        ),
        metrics=MetricsOptions(port=None),
    )
    log("ringray replicas: starting the job")
    with StepsTail(run_dir / "steps.jsonl") as tail:
        controller, _ = start_controller(job)
        try:
            def reached_kill_step() -> bool:
                status = _status(controller)
                ready = not standby or any("a standby group is up" in e.message
                                           for e in status.events)
                return (status.step >= options.kill_after_step and ready) or status.done

            workers_up: list[float] = []  # when the replacement's workers answered

            def rejoined_or_ended() -> bool:
                status = _status(controller)
                if not workers_up and len(status.workers) == len(before) and doomed not in {
                        w.node_id for w in status.workers}:
                    workers_up.append(time.time())
                return (status.done or replica_figures(
                    tail.snapshot(), killed_at, healed_step=_healed_step(_events(run_dir))
                )["rejoined_at"] is not None)

            def tail_or_ended() -> bool:
                return (_status(controller).done or tail_done(replica_figures(
                    tail.snapshot(), killed_at, healed_step=_healed_step(_events(run_dir))),
                    options))

            if not wait_for(reached_kill_step, timeout=options.start_timeout_seconds):
                return _gave_up_replicas(system, _status(controller), tail,
                                         f"step {options.kill_after_step} not reached")
            status = _status(controller)
            if status.done:
                return _gave_up_replicas(system, status, tail,
                                         f"ended early: {status.state} ({status.error})")
            before = status.workers
            doomed = status.workers[-1].node_id  # group 1's ranks come last
            if doomed in {w.node_id for w in status.workers[:len(status.workers) // 2]}:
                return _gave_up_replicas(system, status, tail, "the groups share a node")
            log(f"ringray replicas: killing replica group {LOST_GROUP}'s node at step "
                f"{status.step}")
            killed_at = nodes.kill_and_replace(nodes.by_id(doomed), replace=False)
            rejoined = wait_for(rejoined_or_ended, timeout=options.recovery_timeout_seconds)
            wait_for(tail_or_ended, timeout=options.finish_timeout_seconds if rejoined else 0)
            stopped = not _status(controller).done and tail_done(replica_figures(
                tail.snapshot(), killed_at, healed_step=_healed_step(_events(run_dir))),
                options)
            if stopped:
                log(f"ringray replicas: stopping the job, {options.replica_tail_steps} steps "
                    f"after the replacement's first")
                ray.get(controller.stop.remote())
                wait_for(lambda: _status(controller).done,
                         timeout=options.finish_timeout_seconds)
            status = _status(controller)
        finally:
            if not _status(controller).done:
                ray.get(controller.stop.remote())
            release(controller)
    return ringray_replicas_result(status, tail.snapshot(), _events(run_dir), killed_at,
                                   cut_back=tail.cut_back, stopped=stopped,
                                   workers_up_at=workers_up[0] if workers_up else None,
                                   system=system)


def run_ringray_standby(options: RecoveryBenchOptions, nodes: BenchNodes, work_dir: Path,
                        log: Log) -> RecoveryResult:
    """:func:`run_ringray_replicas` with the replacement's workers started ahead."""
    return run_ringray_replicas(options, nodes, work_dir, log, standby=True)


HEALED = re.compile(rf"^replica group {LOST_GROUP} healed from a live peer at step (\d+) ")


def _healed_step(events: list[dict]) -> int | None:
    """The step the replacement healed into, from its event (the last one logged)."""
    steps = [int(m.group(1)) for e in events if (m := HEALED.match(e["message"]))]
    return steps[-1] if steps else None


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gave_up_replicas(system: str, status: JobStatus, tail: StepsTail,
                      why: str) -> RecoveryResult:
    return RecoveryResult(system=system, scenario="replicas",
                          death_to_first_step_seconds=None, detection_seconds=None,
                          ready_seconds=None, steps_lost=None,
                          restarts=len(status.restarts), final_step=status.step,
                          finished=False, note=why)


def ringray_replicas_result(status: JobStatus, steps: list[tuple[float, dict]],
                            events: list[dict], killed_at: float, *,
                            cut_back: int = 0, stopped: bool = False,
                            workers_up_at: float | None = None,
                            system: str = SYSTEM_REPLICAS) -> RecoveryResult:
    """The figures of the replicas scenario from the stamped steps and the job's events;
    ``stopped``: the harness stopped the job once it had what it measures;
    ``workers_up_at``: when the job's status first listed the replacement's workers (their
    actors up and answering; polled every 0.1 s), for the details."""
    after = [e for e in events if e["time"] >= killed_at]
    lost = next((e for e in after
                 if e["message"].startswith(f"replica group {LOST_GROUP} lost (")), None)
    replaced = next(((e, float(m.group(1))) for e in after
                     if (m := REPLACED.match(e["message"]))), None)
    healed = next((e for e in after if e["message"].startswith(
        f"replica group {LOST_GROUP} healed from a live peer")), None)
    retried = [e["message"] for e in after if "replacement did not start" in e["message"]]
    clean = "stopped" if stopped else "finished"
    notes = []
    if status.state != clean:
        notes.append(f"job {status.state}: {status.error}")
    if status.restarts:
        notes.append(f"{len(status.restarts)} restart(s): {status.restarts[0].reason}")
    if retried:
        notes.append(f"replacement retried {len(retried)}x: {retried[0][:200]}")
    if cut_back:
        notes.append(f"steps.jsonl cut back {cut_back}x")
    figures = replica_figures(steps, killed_at, healed_step=_healed_step(after))
    return replica_result(
        system, figures, killed_at=killed_at,
        detected_at=None if lost is None else lost["time"],
        ready_at=None if replaced is None else replaced[0]["time"],
        replacement_started_at=(None if replaced is None
                                else replaced[0]["time"] - replaced[1]),
        restarts=len(status.restarts), finished=status.state == clean, stopped=stopped,
        note="; ".join(notes),
        details={"workers_up_at": workers_up_at,
                 "healed_event_at": None if healed is None else healed["time"],
                 "healed_event": None if healed is None else healed["message"],
                 "lost_event": None if lost is None else lost["message"]},
    )
