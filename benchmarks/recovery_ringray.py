"""ringray's side of ``benchmarks/recovery.py``: the job under ringray's controller.

The figures come from the controller's ``Restart`` record: ``detected_at``,
``recovery_seconds`` (detection → the first step afterwards) and ``lost_steps``; "ready" is
the controller's ``started …`` event of the restart (every trainer built and restored).
"""

from __future__ import annotations

from pathlib import Path

import ray
from recovery_common import (
    SLOT_RESOURCE,
    BenchNodes,
    Log,
    RecoveryBenchOptions,
    RecoveryResult,
    bench_train_options,
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
        ready_seconds=None if ready_at is None else ready_at - killed_at,
        steps_lost=first.lost_steps,
        restarts=len(status.restarts),
        final_step=status.step,
        finished=finished,
        note=note,
    )
