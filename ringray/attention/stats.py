"""Per-ring-step measurements: compute time, exposed communication time, bytes sent.

Pass a :class:`RingStats` to :func:`ring_attention` and it records one
:class:`RingStepRecord` per ring step, forward and backward; pass nothing and no clock is
read at all.

    stats = RingStats()
    out = ring_attention(q, k, v, group, stats=stats)
    out.sum().backward()
    print(stats.totals("forward").exposed_comm_seconds)

What is measured, and how:

- ``compute_seconds``: the step's kernel calls, merges and gradient sums. On CPU this is the
  process's CPU time (``time.process_time``), so ranks that share cores are not charged for
  each other's time slices; it includes the small CPU cost of the transport threads. On CUDA
  it is the time between two events on the compute stream.
- ``exposed_comm_seconds``: time spent blocked waiting for the next block after the compute
  finished, i.e. communication the compute did not hide. Wall clock on CPU; on CUDA the
  stream stall between an event recorded before the wait and one after it.
- ``bytes_sent``: payload this rank sent during the step.

CUDA events are only read when the records are asked for, so recording adds no host sync to
the training loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingStepRecord:
    phase: str  # "forward" or "backward"
    step: int
    compute_seconds: float
    exposed_comm_seconds: float
    bytes_sent: int


@dataclass(frozen=True)
class RingTotals:
    steps: int
    compute_seconds: float
    exposed_comm_seconds: float
    bytes_sent: int


class StepTimer:
    """Brackets one ring step's compute and its wait. CPU clocks; see :class:`CudaStepTimer`."""

    def start_compute(self) -> None:
        self._compute_start = time.process_time()

    def end_compute(self) -> None:
        self._compute = time.process_time() - self._compute_start
        self._wait_start = time.perf_counter()

    def end_wait(self) -> None:
        self._wait = time.perf_counter() - self._wait_start

    def seconds(self) -> tuple[float, float]:
        """(compute, exposed communication) seconds."""
        return self._compute, self._wait


class CudaStepTimer(StepTimer):
    def __init__(self) -> None:
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def start_compute(self) -> None:
        self._events[0].record()

    def end_compute(self) -> None:
        self._events[1].record()

    def end_wait(self) -> None:
        self._events[2].record()

    def seconds(self) -> tuple[float, float]:
        start, computed, waited = self._events
        waited.synchronize()
        return start.elapsed_time(computed) / 1e3, computed.elapsed_time(waited) / 1e3


class _NullTimer(StepTimer):
    def start_compute(self) -> None:
        pass

    def end_compute(self) -> None:
        pass

    def end_wait(self) -> None:
        pass


NULL_TIMER = _NullTimer()


class RingStats:
    """Collects :class:`RingStepRecord` s from every ring call it is passed to."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, int, StepTimer, int]] = []
        self._records: list[RingStepRecord] = []

    def timer(self, device: torch.device) -> StepTimer:
        """A fresh timer for one step on ``device`` (used by the ring)."""
        return CudaStepTimer() if device.type == "cuda" else StepTimer()

    def add(self, phase: str, step: int, timer: StepTimer, bytes_sent: int) -> None:
        self._pending.append((phase, step, timer, bytes_sent))

    @property
    def records(self) -> list[RingStepRecord]:
        """All records so far (reading them resolves CUDA events: a host sync)."""
        for phase, step, timer, sent in self._pending:
            compute, exposed = timer.seconds()
            self._records.append(RingStepRecord(phase, step, compute, exposed, sent))
        self._pending.clear()
        return list(self._records)

    def totals(self, phase: str | None = None) -> RingTotals:
        """Sums over all records, or over one phase (``"forward"``/``"backward"``)."""
        rows = [r for r in self.records if phase is None or r.phase == phase]
        return RingTotals(
            steps=len(rows),
            compute_seconds=sum(r.compute_seconds for r in rows),
            exposed_comm_seconds=sum(r.exposed_comm_seconds for r in rows),
            bytes_sent=sum(r.bytes_sent for r in rows),
        )

    def clear(self) -> None:
        self._pending.clear()
        self._records.clear()


def overlap_ratio(exposed_comm_seconds: float, transfer_seconds: float) -> float:
    """The share of the communication the compute hid: ``1 - exposed / transfer``.

    ``transfer_seconds`` is what the same exchanges take with no compute in between. 1.0 is
    fully hidden, 0.0 is not hidden at all; below 0 the rank waited longer than the transfer
    itself takes (it waited for a slower rank: load imbalance). No communication counts as 1.0.
    """
    return 1.0 - exposed_comm_seconds / transfer_seconds if transfer_seconds > 0 else 1.0


def imbalance_ratio(per_rank_seconds: Sequence[float]) -> float:
    """``max / mean`` of the ranks' compute: 1.0 is perfect balance."""
    mean = sum(per_rank_seconds) / len(per_rank_seconds)
    return max(per_rank_seconds) / mean if mean > 0 else 1.0
