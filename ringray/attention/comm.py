"""Point-to-point ring communication on a ``torch.distributed`` process group.

A :class:`RingComm` knows this rank's place in the ring and posts one step's sends and
receives as a single ``batch_isend_irecv``; the caller computes while they are in flight and
then waits. Works on any backend with point-to-point support (gloo on CPU, NCCL on CUDA).

Agreement before a call (:mod:`.validation`) does not use the compute group: every group
gets a CPU side group over the same ranks (:func:`agreement_group`, gloo), so checking that
every rank passed the same arguments is a small all-reduce of host integers, with no
host/device copy and no CUDA stream synchronisation.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence

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
    """Sends/receives in flight; :meth:`wait` blocks until all of them are done."""

    def __init__(self, works: list, bytes_sent: int) -> None:
        self._works = works
        self.bytes_sent = bytes_sent

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


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
        return PendingExchange(dist.batch_isend_irecv(ops) if ops else [], sent)

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
