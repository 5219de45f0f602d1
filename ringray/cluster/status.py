"""What a job's controller reports: its state, its restarts, its recent events.

    status = ray.get(controller.status.remote())     # a JobStatus
    status.state, status.step, status.dp, status.restarts[-1].recovery_seconds

Plain frozen dataclasses, so a status crosses from the controller actor to any driver and
into tests and the CLI without Ray-specific types.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ringray.cluster.placement import PlacementPlan
from ringray.train import StepStats


class JobState(StrEnum):
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
class WorkerHealth:
    """The cheap probe: where the worker runs and how far it got."""

    rank: int
    node_id: str
    pid: int
    step: int  # optimizer steps completed (0 before build)
    busy_seconds: float  # how long the current call has been running; 0 when idle


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
class ReplicaLoss:
    """A replica group torn down while the others trained on, and its replacement's heal."""

    group: int
    reason: str  # a FailureKind value
    at_step: int  # the job's committed steps when it was lost
    healed_at_step: int | None = None  # the first step its replacement trained (None: not yet)
    heal_seconds: float | None = None  # joining the quorum and loading a live peer's state


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
    metrics_url: str | None = None  # the controller's Prometheus endpoint, when it serves one
    replica_groups: int = 1  # parallel.dp_replicate; dp counts every group's rings
    replica_losses: tuple[ReplicaLoss, ...] = ()
    nonfinite_skipped: int = 0  # step attempts passed over as not finite (the job's whole run)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def done(self) -> bool:
        return JobState(self.state) in TERMINAL_STATES
