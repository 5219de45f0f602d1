"""The controller's states: values that carry their own data (no Ray here).

    state = Checkpointing(then=MoveOff(failure))     # checkpoint, then leave a draining node
    state.name                                        # JobState.CHECKPOINTING (for the status)

Each state holds what its handler needs to decide (the failure being recovered, what follows
a checkpoint, since when capacity has been awaited), so nothing about a transition lives in
mutable fields of the controller. :mod:`ringray.cluster.machine` has one handler per state;
each returns the next state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ringray.cluster.placement import PlacementPlan
from ringray.cluster.policy import Failure
from ringray.cluster.status import JobState


# ------------------------------------------------------------------ what follows a checkpoint
@dataclass(frozen=True)
class Continue:
    """Back to training (or growing, when capacity for a larger dp has waited long enough)."""


@dataclass(frozen=True)
class Evaluate:
    """Training is done: run the evaluation."""


@dataclass(frozen=True)
class StopAfter:
    """A stop was requested: stop once this checkpoint is committed."""


@dataclass(frozen=True)
class MoveOff:
    """A node is draining: recover from ``failure`` (a preemption) once this checkpoint is
    committed, or, if it fails, from the previous one."""

    failure: Failure


After = Continue | Evaluate | StopAfter | MoveOff


# ------------------------------------------------------------------ states
class State:
    name: ClassVar[JobState]
    terminal: ClassVar[bool] = False


@dataclass(frozen=True)
class Placing(State):
    """Plan where the ranks go on the live nodes; ``waiting_since`` (monotonic seconds) is set
    while no placement fits and the job waits for capacity; ``dp`` is the degree a resize
    asked for (placed exactly when it still fits; otherwise the largest that does)."""

    name: ClassVar[JobState] = JobState.PLACING
    waiting_since: float | None = None
    dp: int | None = None


@dataclass(frozen=True)
class Starting(State):
    """Create the workers of ``plan``, form their group, build the trainers and restore."""

    name: ClassVar[JobState] = JobState.STARTING
    plan: PlacementPlan


@dataclass(frozen=True)
class Running(State):
    name: ClassVar[JobState] = JobState.RUNNING


@dataclass(frozen=True)
class Checkpointing(State):
    name: ClassVar[JobState] = JobState.CHECKPOINTING
    then: After


@dataclass(frozen=True)
class Evaluating(State):
    name: ClassVar[JobState] = JobState.EVALUATING


@dataclass(frozen=True)
class Recovering(State):
    """Tear the ring down and restart it from the last good checkpoint of the run."""

    name: ClassVar[JobState] = JobState.RECOVERING
    failure: Failure


@dataclass(frozen=True)
class Resizing(State):
    """Tear the worker group down and place it again at dp ``to_dp`` (at a checkpoint
    boundary)."""

    name: ClassVar[JobState] = JobState.RESIZING
    to_dp: int


@dataclass(frozen=True)
class Finished(State):
    name: ClassVar[JobState] = JobState.FINISHED
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Failed(State):
    name: ClassVar[JobState] = JobState.FAILED
    terminal: ClassVar[bool] = True
    error: str


@dataclass(frozen=True)
class Stopped(State):
    name: ClassVar[JobState] = JobState.STOPPED
    terminal: ClassVar[bool] = True
    reason: str
