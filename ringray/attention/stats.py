"""Per-ring-step measurements: compute time, exposed communication time (split into transfer
not hidden and waiting for a late peer), bytes sent.

Pass a :class:`RingStats` to :func:`ring_attention` and it records one
:class:`RingStepRecord` per ring step, forward and backward; pass nothing and no clock is
read at all.

    stats = RingStats()
    out = ring_attention(q, k, v, group, stats=stats)
    out.sum().backward()
    print(stats.totals("forward").exposed_comm_seconds)
    # split against a standalone transfer rate (see "Transfer not hidden, or a late peer"):
    print(stats.totals(transfer_seconds_per_byte=rate).peer_wait_seconds)

What is measured, and how:

- ``compute_seconds``: the step's kernel calls, merges and gradient sums. On CPU this is the
  process's CPU time (``time.process_time``), so ranks that share cores are not charged for
  each other's time slices; it includes the small CPU cost of the transport threads. On CUDA
  it is the time between two events on the compute stream.
- ``exposed_comm_seconds``: time spent blocked waiting for the next block after the compute
  finished: communication the compute did not hide, or a peer that was late (split below).
  Wall clock on CPU; on CUDA the stream stall between an event recorded before the wait and
  one after it.
- ``overlap_window_seconds``: from just after the step's exchange was posted to the end of
  its compute, on the same clock as ``exposed_comm_seconds`` (wall clock on CPU, the same
  CUDA events on CUDA): the time the transfer had to hide in.
- ``bytes_sent``: payload this rank sent during the step.

Transfer not hidden, or a late peer. A rank cannot see its peers' clocks, but it knows when
it posted its own exchange and, from a standalone measurement
(:func:`~ringray.attention.comm.ring_transfer_seconds`), how long the step's exchange takes
once both sides have posted: ``transfer = bytes_sent × standalone seconds per byte``. Had
every peer posted when this rank did, the transfer would have been done ``transfer`` seconds
after posting, i.e. ``transfer − window`` after the compute ended (if positive). So each
step's exposed wait splits (:func:`split_exposed`) into

- *transfer not hidden* = ``min(exposed, max(0, transfer − window))``: at most the
  transfer's own duration, so ``overlap = 1 − not hidden ÷ transfer`` stays in [0, 1];
- *waiting for a late peer* = ``exposed − not hidden`` (≥ 0): the rest, which only a peer
  that posted late (a straggler, a descheduled rank, a rank still in its previous step) or a
  transfer slowed beyond its standalone time (by contention with the compute) explains.

It needs no extra collective and no extra device sync: the split is taken when the records
are read, from figures each rank already has. :meth:`RingStats.totals` sums both
(``transfer_exposed_seconds``, ``peer_wait_seconds``; ``exposed_comm_seconds`` stays their
sum) when it is given the standalone rate; without one it cannot split and counts all of the
exposed wait as transfer not hidden. The standalone baseline is timed with the same kind of
timer as the exposed wait (:func:`interval_timer`: ``perf_counter`` on CPU, CUDA events on
the current stream on CUDA), so both sides of the ratio read one clock.

With Ulysses (``ring_attention(..., ulysses_group=...)``) each all-to-all adds one
:class:`AllToAllRecord`: its ``seconds`` are wholly exposed (nothing computes while an
all-to-all runs, and it waits for the slowest rank of the Ulysses group), measured on the
wall clock on CPU and between two CUDA events on the compute stream on CUDA; its
``bytes_sent`` are what left this rank (the share it keeps is not counted).
:meth:`RingStats.totals` sums them as ``a2a_seconds`` / ``a2a_bytes_sent`` beside the ring's
figures, which keep their meaning (``bytes_sent`` is the ring's alone).

What the mask saved. A ring call sends each K/V block only to the ranks that read it
(:mod:`~ringray.attention.transfers`); each call adds one :class:`RingCallRecord` per phase
with the messages this rank sent and the ones it skipped against the plain ring (which sends
N - 1 K/V blocks forward, N - 1 K/V blocks and N - 1 dK/dV sums backward, per rank), in
messages and in bytes. :meth:`RingStats.totals` sums them (``transfers``,
``transfers_skipped``, ``bytes_skipped``).

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
    # From posting the exchange to the end of compute, on exposed_comm_seconds's clock.
    overlap_window_seconds: float = 0.0


@dataclass(frozen=True)
class RingCallRecord:
    """One ring call's messages from this rank, in one phase, against the plain ring."""

    phase: str  # "forward" or "backward"
    transfers: int  # K/V blocks and dK/dV sums sent
    transfers_skipped: int  # the plain ring's messages that were not sent
    bytes_sent: int
    bytes_skipped: int  # the plain ring's bytes that were not sent


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
    exposed_comm_seconds: float  # the ring's: transfer_exposed_seconds + peer_wait_seconds
    bytes_sent: int  # the ring's
    a2a_seconds: float = 0.0  # the Ulysses all-to-alls' (all exposed); 0 without Ulysses
    a2a_bytes_sent: int = 0
    a2a_calls: int = 0
    # Split against a standalone rate (0, and all exposed time unhidden transfer, without one).
    transfer_seconds: float = 0.0  # the steps' exchanges alone: bytes × seconds per byte
    transfer_exposed_seconds: float = 0.0  # transfer not hidden, each step's ≤ its transfer
    peer_wait_seconds: float = 0.0  # waiting for a late peer
    # Messages sent, and those the plain ring would have sent and the mask made needless.
    transfers: int = 0
    transfers_skipped: int = 0
    bytes_skipped: int = 0


class StepTimer:
    """Brackets one ring step's compute and its wait; :meth:`start_compute` is called just
    after the step's exchange is posted. CPU clocks (compute in CPU time, the window and the
    wait on the wall clock); see :class:`CudaStepTimer`."""

    def start_compute(self) -> None:
        self._posted = time.perf_counter()
        self._compute_start = time.process_time()

    def end_compute(self) -> None:
        self._compute = time.process_time() - self._compute_start
        self._wait_start = time.perf_counter()
        self._window = self._wait_start - self._posted

    def end_wait(self) -> None:
        self._wait = time.perf_counter() - self._wait_start

    def seconds(self) -> tuple[float, float, float]:
        """(compute, overlap window, exposed communication) seconds."""
        return self._compute, self._window, self._wait


class CudaStepTimer(StepTimer):
    def __init__(self) -> None:
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def start_compute(self) -> None:
        self._events[0].record()

    def end_compute(self) -> None:
        self._events[1].record()

    def end_wait(self) -> None:
        self._events[2].record()

    def seconds(self) -> tuple[float, float, float]:
        start, computed, waited = self._events
        waited.synchronize()
        compute = start.elapsed_time(computed) / 1e3  # on the stream: also the window
        return compute, compute, computed.elapsed_time(waited) / 1e3


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


def interval_timer(device: torch.device) -> IntervalTimer:
    """A fresh timer for one blocking operation on ``device``: CUDA events on the current
    stream on CUDA, the wall clock on CPU; the clock exposed ring waits are read on."""
    return CudaIntervalTimer() if device.type == "cuda" else IntervalTimer()


class RingStats:
    """Collects :class:`RingStepRecord` s from every ring call it is passed to."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, int, StepTimer, int]] = []
        self._records: list[RingStepRecord] = []
        self._pending_a2a: list[tuple[str, str, IntervalTimer, int]] = []
        self._a2a_records: list[AllToAllRecord] = []
        self.calls: list[RingCallRecord] = []  # one per ring call and phase

    def timer(self, device: torch.device) -> StepTimer:
        """A fresh timer for one step on ``device`` (used by the ring)."""
        return CudaStepTimer() if device.type == "cuda" else StepTimer()

    def add(self, phase: str, step: int, timer: StepTimer, bytes_sent: int) -> None:
        self._pending.append((phase, step, timer, bytes_sent))

    def add_call(self, record: RingCallRecord) -> None:
        self.calls.append(record)

    def a2a_timer(self, device: torch.device) -> IntervalTimer:
        """A fresh timer for one all-to-all on ``device`` (used by the Ulysses path)."""
        return interval_timer(device)

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
            compute, window, exposed = timer.seconds()
            self._records.append(RingStepRecord(phase, step, compute, exposed, sent, window))
        self._pending.clear()
        return list(self._records)

    def totals(self, phase: str | None = None, *,
               transfer_seconds_per_byte: float | None = None) -> RingTotals:
        """Sums over all records, or over one phase (``"forward"``/``"backward"``).

        ``transfer_seconds_per_byte``: the ring's standalone rate (from
        :func:`~ringray.attention.comm.ring_transfer_seconds`, on this device), against
        which each step's exposed wait is split (:func:`split_exposed`); ``None``: no split
        (all exposed time is counted as transfer not hidden, ``transfer_seconds`` is 0)."""
        rows = [r for r in self.records if phase is None or r.phase == phase]
        a2a = [r for r in self.a2a_records if phase is None or r.phase == phase]
        calls = [c for c in self.calls if phase is None or c.phase == phase]
        transfer = not_hidden = peer_wait = 0.0
        for r in rows:
            if transfer_seconds_per_byte is None:
                not_hidden += r.exposed_comm_seconds
                continue
            step_transfer = r.bytes_sent * transfer_seconds_per_byte
            hidden_not, late = split_exposed(r.exposed_comm_seconds, r.overlap_window_seconds,
                                             step_transfer)
            transfer += step_transfer
            not_hidden += hidden_not
            peer_wait += late
        return RingTotals(
            steps=len(rows),
            compute_seconds=sum(r.compute_seconds for r in rows),
            exposed_comm_seconds=sum(r.exposed_comm_seconds for r in rows),
            bytes_sent=sum(r.bytes_sent for r in rows),
            a2a_seconds=sum(r.seconds for r in a2a),
            a2a_bytes_sent=sum(r.bytes_sent for r in a2a),
            a2a_calls=len(a2a),
            transfer_seconds=transfer,
            transfer_exposed_seconds=not_hidden,
            peer_wait_seconds=peer_wait,
            transfers=sum(c.transfers for c in calls),
            transfers_skipped=sum(c.transfers_skipped for c in calls),
            bytes_skipped=sum(c.bytes_skipped for c in calls),
        )

    def clear(self) -> None:
        self._pending.clear()
        self._records.clear()
        self._pending_a2a.clear()
        self._a2a_records.clear()
        self.calls.clear()


def split_exposed(exposed_seconds: float, window_seconds: float,
                  transfer_seconds: float) -> tuple[float, float]:
    """One ring step's exposed wait as (transfer not hidden, waiting for a late peer).

    ``window_seconds``: from posting the exchange to the end of the compute;
    ``transfer_seconds``: what the step's exchange takes alone once both sides have posted.
    Had the peers posted with this rank, the transfer would have ended ``transfer − window``
    after the compute (if that is positive): that much of the wait, and no more, is the
    transfer the compute did not hide; the rest is a late peer. Both parts are ≥ 0, the first
    is ≤ ``transfer_seconds``, and they sum to ``exposed_seconds``.
    """
    not_hidden = min(max(exposed_seconds, 0.0), max(0.0, transfer_seconds - window_seconds))
    return not_hidden, max(exposed_seconds - not_hidden, 0.0)


def overlap_ratio(transfer_exposed_seconds: float, transfer_seconds: float) -> float:
    """The share of the communication the compute hid: ``1 - not hidden / transfer``.

    ``transfer_seconds`` is what the same exchanges take with no compute in between;
    ``transfer_exposed_seconds`` the part of the waits that was the transfer not hidden
    (:func:`split_exposed`, never more than ``transfer_seconds``), so the ratio is in [0, 1]:
    1.0 is fully hidden, 0.0 is not hidden at all. Waiting for a late peer is not in it; it is
    reported on its own (``peer_wait_seconds``). No communication counts as 1.0.
    """
    return 1.0 - transfer_exposed_seconds / transfer_seconds if transfer_seconds > 0 else 1.0


def imbalance_ratio(per_rank_seconds: Sequence[float]) -> float:
    """``max / mean`` of the ranks' compute: 1.0 is perfect balance."""
    mean = sum(per_rank_seconds) / len(per_rank_seconds)
    return max(per_rank_seconds) / mean if mean > 0 else 1.0
