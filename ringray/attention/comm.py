"""Point-to-point ring communication on a ``torch.distributed`` process group.

A :class:`RingComm` knows this rank's place in the ring and posts one step's sends and
receives as a single ``batch_isend_irecv``; the caller computes while they are in flight and
then waits. Works on any backend with point-to-point support (gloo on CPU, NCCL on CUDA).

Ordering against the compute (:class:`StepScheduler`). ProcessGroupNCCL makes its stream
wait for the caller's current stream before it sends, so a step posted on the compute stream
waits for every kernel enqueued before it: the previous step's whole compute, though the own
block's rows were ready when the call began. On CUDA (:class:`CudaStepScheduler`) a step is
therefore posted from a side stream that waits only for what the step's messages need: the
event after which the own block (in the backward, each returned dK/dV sum) was ready, and the
events after the last compute that used each receive buffer (:meth:`StepScheduler.mark`,
:meth:`Posting.after`). Sends and receives stay one ``batch_isend_irecv`` per step (separate
batches on one NCCL stream can deadlock a ring); the compute stream still waits for NCCL's
at :meth:`PendingExchange.wait`. On CPU (gloo) every operation is done by the host in
program order, and the scheduler is a no-op (:data:`NULL_SCHEDULER`): nothing is copied or
recorded.

Agreement before a call (:mod:`.validation`) does not use the compute group: every group
gets a CPU side group over the same ranks (:func:`agreement_group`, gloo), so checking that
every rank passed the same arguments is a small all-reduce of host integers, with no
host/device copy and no CUDA stream synchronisation.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringray.attention.backends.common import accumulation_dtype
from ringray.attention.groups import group_timeout
from ringray.attention.stats import interval_timer

_AGREEMENT_GROUPS: dict[tuple[int, ...], tuple[object, dist.ProcessGroup]] = {}


def agreement_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The CPU (gloo) side group over ``group``'s ranks (``None``: the default group), made
    on first use by those ranks alone (local synchronisation: other rings need not join) and
    kept for the life of the default group. It carries only host-side agreement traffic,
    apart from the compute group's K/V exchange. Under PyTorch's ``fake`` testing backend
    (one process standing for one rank of a job, :mod:`ringray.bench.simulate`), where gloo
    cannot be made, it is the group itself: the fake backend answers at once."""
    if dist.get_backend(group) == "fake":
        return group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    world = dist.group.WORLD
    known = _AGREEMENT_GROUPS.get(ranks)
    if known is not None and known[0] is world:
        return known[1]
    side = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                          timeout=group_timeout(group))
    _AGREEMENT_GROUPS[ranks] = (world, side)
    return side


def release_agreement_groups() -> None:
    """Drop this module's references to the side groups (and to the default group they were
    made under). Registered to run at exit, while the interpreter is whole: gloo groups still
    referenced when the interpreter finalises are destroyed after its runtime, and the
    process aborts ("terminate called without an active exception") even after
    ``destroy_process_group``."""
    _AGREEMENT_GROUPS.clear()


atexit.register(release_agreement_groups)


def agree_max(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise maximum of a CPU int64 vector over ``group``'s ranks, through its
    :func:`agreement_group` (blocking; host only)."""
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=agreement_group(group))
    return values


class PendingExchange:
    """Sends/receives in flight; :meth:`wait` blocks until all of them are done (on CUDA: the
    current stream waits for NCCL's). It holds the exchanged tensors until then, so that no
    tensor made for the exchange (gathered rows, a receive buffer) is freed while it is in
    flight."""

    def __init__(self, works: list, bytes_sent: int,
                 tensors: Sequence[torch.Tensor] = ()) -> None:
        self._works = works
        self._tensors = tensors
        self.bytes_sent = bytes_sent

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], ()


class RingComm:
    """This rank's view of a ring over ``group`` (``None``: the default group, or a single
    process when ``torch.distributed`` is not initialised)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            if group is not None:
                raise ValueError("group: a process group was given but torch.distributed "
                                 "is not initialised")
            self.rank, self.world_size = 0, 1
        if self.world_size > 1:
            self._next = self._global_rank((self.rank + 1) % self.world_size)
            self._prev = self._global_rank((self.rank - 1) % self.world_size)

    def post(
        self,
        send: Sequence[tuple[torch.Tensor, int, int]],
        recv: Sequence[tuple[torch.Tensor, int, int]],
    ) -> PendingExchange:
        """Post point-to-point messages to any ranks of the ring: ``send`` and ``recv`` are
        ``(tensor, ring rank, tag)``. Both sides give a message the same tag (one per kind
        of message) and list their messages in the same order of tags, so two messages
        between the same pair of ranks pair up by tag (gloo) and by order (NCCL)."""
        ops = []
        for tensor, peer, tag in send:
            ops.append(dist.P2POp(dist.isend, tensor, self._global_rank(peer), self.group, tag))
        for tensor, peer, tag in recv:
            ops.append(dist.P2POp(dist.irecv, tensor, self._global_rank(peer), self.group, tag))
        sent = sum(t.numel() * t.element_size() for t, _, _ in send)
        tensors = [t for t, _, _ in send] + [t for t, _, _ in recv]
        return PendingExchange(dist.batch_isend_irecv(ops) if ops else [], sent, tensors)

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def exchange(
        self,
        send: Sequence[torch.Tensor],
        recv: Sequence[torch.Tensor],
        *,
        reverse: bool = False,
    ) -> PendingExchange:
        """Post ``send[i]`` to the next rank and ``recv[i]`` from the previous one (or the
        other way round with ``reverse``). Message i uses tag i, so several messages between
        the same two ranks (a ring of two) cannot be confused."""
        to_peer, from_peer = (self._prev, self._next) if reverse else (self._next, self._prev)
        ops = []
        for tag, tensor in enumerate(send):
            ops.append(dist.P2POp(dist.isend, tensor, to_peer, self.group, tag))
        for tag, tensor in enumerate(recv):
            ops.append(dist.P2POp(dist.irecv, tensor, from_peer, self.group, tag))
        sent = sum(t.numel() * t.element_size() for t in send)
        return PendingExchange(dist.batch_isend_irecv(ops) if ops else [], sent)

    def all_max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of a CPU int64 vector over the ring, on its CPU side group
        (blocking, no device sync)."""
        return agree_max(values, self.group) if self.world_size > 1 else values


Message = tuple[torch.Tensor, int, int]
"""One point-to-point message of a step: ``(tensor, ring rank, tag)``."""


@dataclass(frozen=True, eq=False)
class StreamMark:
    """A point on one of a ring call's streams, for later work to wait for
    (:meth:`StepScheduler.mark`, :meth:`Posting.mark`)."""

    label: str
    """What was ready there (``"own"``, ``"sum 2"``, ``"free"``): for readers and tests."""
    posting: int
    """How many of the call's postings had begun when it was made."""
    on_side: bool
    """Made on the postings' stream, not on the compute stream."""
    event: object = None
    """The CUDA event recorded there, or a recording scheduler's own token."""


class Posting:
    """One step's messages being posted: the context :meth:`StepScheduler.posting` returns.
    What runs inside it (gathering the rows to send, making a receive buffer, the exchange
    itself) runs where the step is posted, after the marks given to :meth:`after`. This base
    class posts in program order (CPU, gloo): every method but :meth:`exchange` does
    nothing."""

    def __enter__(self) -> Posting:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def after(self, mark: StreamMark | None) -> None:
        """What follows in this posting (gathers, the exchange) waits for ``mark``."""

    def made(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` was allocated inside this posting and is used by the compute later:
        kept from reuse until the compute is done with it. Returns it."""
        return tensor

    def mark(self, label: str, tensor: torch.Tensor | None = None) -> StreamMark | None:
        """A point in this posting, after what it has run so far (``tensor``: the tensor it
        concerns, for a recording scheduler)."""
        return None

    def exchange(self, comm: RingComm, send: Sequence[Message],
                 recv: Sequence[Message]) -> PendingExchange:
        """Post the step's sends and receives as one batch (:meth:`RingComm.post`)."""
        return comm.post(send, recv)


_DIRECT_POSTING = Posting()


class StepScheduler:
    """How a ring call orders its postings against its compute. This base class is the no-op
    one (:data:`NULL_SCHEDULER`) for CPU and gloo, where the host runs every operation in
    program order: marks are ``None`` and nothing is recorded, copied or waited for."""

    def mark(self, label: str, tensor: torch.Tensor | None = None) -> StreamMark | None:
        """A point on the compute stream, after everything enqueued so far: ``"own"`` once the
        own block is ready, ``"sum B"`` once block B's dK/dV sum is, ``"free"`` once the
        last compute that used ``tensor`` (a pool buffer given back) is enqueued."""
        return None

    def posting(self) -> Posting:
        """The context one step's messages are posted in (one per step that exchanges)."""
        return _DIRECT_POSTING

    def compute_after(self, mark: StreamMark | None) -> None:
        """The compute stream waits for ``mark`` (a buffer a posting gave back)."""

    def reusable(self, mark: StreamMark | None) -> bool:
        """Whether a buffer given back at ``mark`` can receive in the posting under way
        without waiting for the previous step's compute."""
        return True


NULL_SCHEDULER = StepScheduler()


class _MarkedPosting(Posting):
    def __init__(self, scheduler: MarkingScheduler) -> None:
        self._scheduler = scheduler

    def __enter__(self) -> Posting:
        self._scheduler._enter_side()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._scheduler._leave_side()

    def after(self, mark: StreamMark | None) -> None:
        if mark is not None and not mark.on_side:  # the side stream is in order already
            self._scheduler._wait(True, mark)

    def made(self, tensor: torch.Tensor) -> torch.Tensor:
        self._scheduler._made(tensor)
        return tensor

    def mark(self, label: str, tensor: torch.Tensor | None = None) -> StreamMark:
        scheduler = self._scheduler
        return StreamMark(label=label, posting=scheduler.postings, on_side=True,
                          event=scheduler._record(True, label, tensor))

    def exchange(self, comm: RingComm, send: Sequence[Message],
                 recv: Sequence[Message]) -> PendingExchange:
        return self._scheduler._exchange(comm, send, recv)


class MarkingScheduler(StepScheduler):
    """A scheduler whose postings run on a stream of their own, ordered against the compute
    stream by marks alone. A receive buffer is reused only once the compute that last used
    it was enqueued before the previous posting began (:meth:`reusable`), so a step's
    receive never waits for the previous step's compute: the buffer pools hold one buffer
    more, and receives run a step ahead. Subclasses say what a mark and a wait are
    (:class:`CudaStepScheduler`; the tests' recording one)."""

    def __init__(self) -> None:
        self.postings = 0

    def mark(self, label: str, tensor: torch.Tensor | None = None) -> StreamMark:
        return StreamMark(label=label, posting=self.postings, on_side=False,
                          event=self._record(False, label, tensor))

    def posting(self) -> Posting:
        self.postings += 1
        return _MarkedPosting(self)

    def compute_after(self, mark: StreamMark | None) -> None:
        if mark is not None and mark.on_side:  # the compute stream is in order already
            self._wait(False, mark)

    def reusable(self, mark: StreamMark | None) -> bool:
        # Made on the side stream, or on the compute stream before the previous posting.
        return mark is None or mark.on_side or mark.posting <= self.postings - 2

    def _record(self, on_side: bool, label: str, tensor: torch.Tensor | None) -> object:
        raise NotImplementedError

    def _wait(self, on_side: bool, mark: StreamMark) -> None:
        raise NotImplementedError

    def _enter_side(self) -> None:
        pass

    def _leave_side(self) -> None:
        pass

    def _made(self, tensor: torch.Tensor) -> None:
        pass

    def _exchange(self, comm: RingComm, send: Sequence[Message],
                  recv: Sequence[Message]) -> PendingExchange:
        return comm.post(send, recv)


class CudaStepScheduler(MarkingScheduler):
    """Postings on a side stream of ``device`` (high priority, so a gather of rows to send
    is not queued behind attention kernels), ordered by CUDA events against the compute
    stream, the stream current when it is made."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._compute = torch.cuda.current_stream(device)
        self._side = torch.cuda.Stream(device, priority=-1)  # clamped to the highest
        self._inside: list[torch.cuda.StreamContext] = []  # the postings entered

    def _stream(self, on_side: bool) -> torch.cuda.Stream:
        return self._side if on_side else self._compute

    def _record(self, on_side: bool, label: str, tensor: torch.Tensor | None) -> object:
        event = torch.cuda.Event()
        event.record(self._stream(on_side))
        return event

    def _wait(self, on_side: bool, mark: StreamMark) -> None:
        self._stream(on_side).wait_event(mark.event)

    def _enter_side(self) -> None:
        context = torch.cuda.stream(self._side)
        context.__enter__()
        self._inside.append(context)

    def _leave_side(self) -> None:
        self._inside.pop().__exit__(None, None, None)

    def _made(self, tensor: torch.Tensor) -> None:
        # Allocated on the side stream, read by the compute stream after the exchange's
        # wait: its memory returns to the side stream's pool only once the compute stream
        # has passed the point where it is freed.
        tensor.record_stream(self._compute)


def step_scheduler(device: torch.device) -> StepScheduler:
    """The scheduler for one ring phase on ``device``: a side stream ordered by events on
    CUDA, the no-op elsewhere."""
    return CudaStepScheduler(device) if device.type == "cuda" else NULL_SCHEDULER


def ring_transfer_seconds(comm: RingComm, k_local: torch.Tensor) -> tuple[float, int]:
    """Seconds and bytes of a plain ring call's exchanges (forward and backward, every block
    relayed round the ring) with no compute in between, for this rank's K block
    ``k_local`` ``(batch, local_seq, kv_heads, head_dim)``: a transfer rate (seconds per
    byte) that holds whatever a call's mask lets it skip. Collective over ``comm``'s ring;
    the baseline an overlap ratio is taken against, so it is timed as exposed ring waits are
    (:func:`~.stats.interval_timer`): the wall clock on CPU, CUDA events on the current
    stream around the post and the wait on CUDA (read once, at the end)."""
    world = comm.world_size
    if world == 1:
        return 0.0, 0
    kv = torch.stack((k_local.transpose(1, 2), k_local.transpose(1, 2))).contiguous()
    kv_in = torch.empty_like(kv)
    dkv = torch.zeros(kv.shape, dtype=accumulation_dtype(kv.dtype), device=kv.device)
    dkv_in = torch.empty_like(dkv)  # dK/dV travel in float32, as the ring sends them
    timers, total_bytes = [], 0
    exchanges = [([kv], [kv_in], False)] * (world - 1)  # forward
    for step in range(world):  # backward: K/V, then K/V with dK/dV, then dK/dV alone
        send, recv = ([kv], [kv_in]) if step < world - 1 else ([], [])
        if step > 0:
            send, recv = send + [dkv], recv + [dkv_in]
        exchanges.append((send, recv, True))
    dist.barrier(group=comm.group)
    for send, recv, reverse in exchanges:
        timer = interval_timer(kv.device)
        timer.start()
        pending = comm.exchange(send, recv, reverse=reverse)
        pending.wait()
        timer.stop()
        timers.append(timer)
        total_bytes += pending.bytes_sent
    return sum(timer.seconds() for timer in timers), total_bytes
