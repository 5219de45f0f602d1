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

With Ulysses (``ring_attention(..., ulysses_group=...)``) each all-to-all adds one
:class:`AllToAllRecord`: its ``seconds`` are wholly exposed (nothing computes while an
all-to-all runs, and it waits for the slowest rank of the Ulysses group), measured on the
wall clock on CPU and between two CUDA events on the compute stream on CUDA; its
``bytes_sent`` are what left this rank (the share it keeps is not counted).
:meth:`RingStats.totals` sums them as ``a2a_seconds`` / ``a2a_bytes_sent`` beside the ring's
figures, which keep their meaning (``bytes_sent`` is the ring's alone).

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
class AllToAllRecord:
    phase: str  # "forward" or "backward"
    name: str  # what moved: "qkv", "out", "lse" (forward); "dout", "dqkv" (backward)
    seconds: float  # exposed: the all-to-all, its packing copies and the wait for its peers
    bytes_sent: int  # what left this rank


@dataclass(frozen=True)
class RingTotals:
    steps: int
    compute_seconds: float
    exposed_comm_seconds: float  # the ring's
    bytes_sent: int  # the ring's
    a2a_seconds: float = 0.0  # the Ulysses all-to-alls' (all exposed); 0 without Ulysses
    a2a_bytes_sent: int = 0
    a2a_calls: int = 0


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


class IntervalTimer:
    """Brackets one blocking operation (an all-to-all): wall clock on CPU, since waiting is
    what it costs; see :class:`CudaIntervalTimer`."""

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        self._seconds = time.perf_counter() - self._start

    def seconds(self) -> float:
        return self._seconds


class CudaIntervalTimer(IntervalTimer):
    def __init__(self) -> None:
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def start(self) -> None:
        self._events[0].record()

    def stop(self) -> None:
        self._events[1].record()

    def seconds(self) -> float:
        start, stop = self._events
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3


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
        self._pending_a2a: list[tuple[str, str, IntervalTimer, int]] = []
        self._a2a_records: list[AllToAllRecord] = []

    def timer(self, device: torch.device) -> StepTimer:
        """A fresh timer for one step on ``device`` (used by the ring)."""
        return CudaStepTimer() if device.type == "cuda" else StepTimer()

    def add(self, phase: str, step: int, timer: StepTimer, bytes_sent: int) -> None:
        self._pending.append((phase, step, timer, bytes_sent))

    def a2a_timer(self, device: torch.device) -> IntervalTimer:
        """A fresh timer for one all-to-all on ``device`` (used by the Ulysses path)."""
        return CudaIntervalTimer() if device.type == "cuda" else IntervalTimer()

    def add_a2a(self, phase: str, name: str, timer: IntervalTimer, bytes_sent: int) -> None:
        self._pending_a2a.append((phase, name, timer, bytes_sent))

    @property
    def a2a_records(self) -> list[AllToAllRecord]:
        """The Ulysses all-to-alls so far (reading them resolves CUDA events: a host sync)."""
        for phase, name, timer, sent in self._pending_a2a:
            self._a2a_records.append(AllToAllRecord(phase, name, timer.seconds(), sent))
        self._pending_a2a.clear()
        return list(self._a2a_records)

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
        a2a = [r for r in self.a2a_records if phase is None or r.phase == phase]
        return RingTotals(
            steps=len(rows),
            compute_seconds=sum(r.compute_seconds for r in rows),
            exposed_comm_seconds=sum(r.exposed_comm_seconds for r in rows),
            bytes_sent=sum(r.bytes_sent for r in rows),
            a2a_seconds=sum(r.seconds for r in a2a),
            a2a_bytes_sent=sum(r.bytes_sent for r in a2a),
            a2a_calls=len(a2a),
        )

    def clear(self) -> None:
        self._pending.clear()
        self._records.clear()
        self._pending_a2a.clear()
        self._a2a_records.clear()


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
