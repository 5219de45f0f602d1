"""What can go wrong with a job's worker group, as the machine sees it (no Ray here).

- :class:`WorkerGroupFailure`: a restart from the last good checkpoint may fix it (a dead worker or
  node, a hang, a preemption, an I/O error); it carries a :class:`~ringray.cluster.policy.Failure`.
- :class:`JobError`: no restart can fix it (a worker raised ``ValueError``: the job's options,
  its checkpoint location, a full disk, another model's checkpoint).
- :class:`StopRequested`: a wait was cut short because the job is stopping.
- :class:`CallTimeout`: not every worker answered in time (turned into a hang or a start
  failure by whoever waited).
"""

from __future__ import annotations

from ringray.cluster.policy import Failure


class WorkerGroupFailure(Exception):
    """Recover from ``failure``."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.detail)
        self.failure = failure


class JobError(Exception):
    """A failure that no restart can fix; the message is one line saying why."""


class StopRequested(Exception):
    """A wait was cut short: the job is stopping."""


class CallTimeout(Exception):
    """Not every worker answered in time."""
