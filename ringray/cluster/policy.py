"""What the controller should do, as pure functions from plain data to decisions.

    decision = on_failure(failure, restarts=2, max_failures=3)       # Recover(...) or GiveUp(...)
    decision = on_drain(seconds_left=40, step_seconds=2, checkpoint_seconds=5)
    new_dp = grow_to(current_dp=1, feasible_dp=2, larger_since=t0, now=t1, grow_after_seconds=10)

The controller observes the cluster, calls these, and carries out what they return; nothing
here touches Ray, so every branch is unit-tested without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    """Why a ring was torn down (the ``reason`` of a restart)."""

    ACTOR_DIED = "actor_died"  # a worker process exited (killed, crashed, OOM)
    NODE_DIED = "node_died"  # a node hosting a worker stopped answering health checks
    HANG = "hang"  # no step finished within the step timeout
    PREEMPTED = "preempted"  # a node hosting a worker is draining (preemption notice)
    WORKER_ERROR = "worker_error"  # a step raised (e.g. a collective broken by a dead peer)
    STARTUP = "startup"  # workers or process groups did not come up in time
    CHECKPOINT_FAILED = "checkpoint_failed"  # a save failed in a way that may pass (I/O)


@dataclass(frozen=True, kw_only=True)
class Failure:
    kind: FailureKind
    detail: str  # one line for the log: which rank, which node, what was seen
    nodes: tuple[str, ...] = ()  # nodes to leave out of the next placement


@dataclass(frozen=True, kw_only=True)
class Drain:
    """A preemption notice: ``nodes`` (holding ranks of the job) are draining, to be gone at
    ``deadline_unix`` (wall-clock seconds; ``None``: no deadline given). Absolute, so a
    decision taken later uses the time actually left."""

    nodes: tuple[str, ...]
    deadline_unix: float | None

    def seconds_left(self, now_unix: float) -> float | None:
        return None if self.deadline_unix is None else self.deadline_unix - now_unix


@dataclass(frozen=True, kw_only=True)
class Recover:
    """Kill every worker, re-plan on the live nodes without ``avoid_nodes``, restore the last
    complete checkpoint and continue."""

    reason: FailureKind
    avoid_nodes: tuple[str, ...]
    counts_as_failure: bool  # preemptions are the cloud's doing, not the job's


@dataclass(frozen=True, kw_only=True)
class GiveUp:
    reason: str


def on_failure(failure: Failure, *, restarts: int, max_failures: int) -> Recover | GiveUp:
    """Recover from a failure while fewer than ``max_failures`` failures have been recovered.

    ``restarts`` counts the failures recovered so far (preemptions excluded). A preemption is
    always recovered: losing a spot node is expected, and it must not use up the budget meant
    for faults.
    """
    counts = failure.kind is not FailureKind.PREEMPTED
    if counts and restarts >= max_failures:
        return GiveUp(
            reason=f"{failure.kind.value}: {failure.detail} (max_failures={max_failures} "
            f"already used)"
        )
    return Recover(reason=failure.kind, avoid_nodes=failure.nodes, counts_as_failure=counts)


@dataclass(frozen=True, kw_only=True)
class CheckpointFirst:
    """There is time: finish the current step, checkpoint, then move off the draining nodes."""


@dataclass(frozen=True, kw_only=True)
class MoveNow:
    """Too little time for a checkpoint: move now and restore the last complete one."""

    why: str


# A checkpoint must fit in the notice with this much room to spare.
DRAIN_SAFETY_FACTOR = 1.5


def on_drain(
    *, seconds_left: float | None, step_seconds: float | None, checkpoint_seconds: float | None
) -> CheckpointFirst | MoveNow:
    """Whether a checkpoint fits before a draining node goes away.

    ``seconds_left`` is the time to the drain deadline (``None``: no deadline given). The
    work needed is the rest of the running step plus one checkpoint, each estimated from the
    last measured one (unknown counts as zero: the first checkpoint is attempted).
    """
    if seconds_left is None:
        return CheckpointFirst()
    needed = ((step_seconds or 0.0) + (checkpoint_seconds or 0.0)) * DRAIN_SAFETY_FACTOR
    if seconds_left >= needed:
        return CheckpointFirst()
    return MoveNow(
        why=f"{seconds_left:.1f} s left before the drain deadline, a step and a checkpoint "
        f"need about {needed:.1f} s"
    )


def dp_options(*, dp_min: int, dp_max: int, global_batch: int) -> tuple[int, ...]:
    """The dp degrees the job may run at, largest first: within the range, and dividing the
    global batch (each replica takes an equal share)."""
    return tuple(d for d in range(dp_max, dp_min - 1, -1) if global_batch % d == 0)


def track_larger_capacity(
    larger_since: float | None, *, current_dp: int, feasible_dp: int, now: float
) -> float | None:
    """When the live cluster first (and continuously since) supported a larger dp than the
    job runs at; ``None`` while it does not. Any moment without the capacity resets it."""
    if feasible_dp <= current_dp:
        return None
    return now if larger_since is None else larger_since


def grow_to(
    *,
    current_dp: int,
    feasible_dp: int,
    larger_since: float | None,
    now: float,
    grow_after_seconds: float,
) -> int | None:
    """The dp to grow to at this checkpoint boundary, or ``None`` to stay.

    Hysteresis: the larger capacity must have been live for ``grow_after_seconds`` without a
    gap, so a node that flickers in and out never makes the job restart twice. The job only
    grows here; it shrinks only when a failure forces it.
    """
    if feasible_dp <= current_dp or larger_since is None:
        return None
    if now - larger_since < grow_after_seconds:
        return None
    return feasible_dp
