"""Ring attention: exact attention over a sequence split across the ranks of a process group.

    out = ring_attention(q, k, v, group, layout="zigzag", causal=True)

``q`` is ``(batch, local_seq, q_heads, head_dim)``, ``k``/``v`` are
``(batch, local_seq, kv_heads, head_dim)``: this rank's tokens, in the layout's local order
(see :mod:`ringray.attention.layouts`). The result equals attention over the whole sequence,
restricted to this rank's queries.

Packed documents: ``documents=[...]`` gives the global sequence's document lengths (the same
on every rank, shared by the batch's rows); attention then stays inside each document
(:mod:`ringray.attention.documents`). The plan skips K/V blocks and pieces that lie wholly in
other documents, and ``layout="balanced"`` spreads the documents' work evenly.

Sliding window: ``window=W`` (Mistral-style, causal) lets a query see only keys at most
``W - 1`` positions before it, on global positions (so, with documents, within its own
document). Blocks and tiles wholly beyond the window are neither computed nor sent.

Ulysses × ring: ``ulysses_group=`` adds an inner head all-to-all (one node) around the ring
(across nodes); ``group`` is then the ring of ranks sharing this rank's ulysses index, and
the layout covers the whole grid (``make_layout(kind, R * U, S, ulysses=U)``). See
:mod:`ringray.attention.ulysses`.

Communication: each K/V block goes only to the ranks whose queries see one of its keys,
straight from its owner, in rounds in which every rank sends and receives at most one block
(:mod:`ringray.attention.transfers`; with every block read, round t is ring distance t). A
step posts one round's messages before its compute and waits for them after it, so the
transfer hides behind the compute; rounds in which a rank neither sends nor receives are not
steps at all on that rank. On CUDA a step is posted from a side stream that waits only for
what its messages need (:class:`~ringray.attention.comm.StepScheduler`): the own block (in
the backward, the dK/dV sum it returns), and the compute that last used each receive buffer,
given back at least a step earlier; so a send never queues behind the previous step's
compute, and receives run a step ahead (one buffer more in each pool than on CPU).

Forward: the own block first, then each received block; where the layout is balanced in
total but not per step, the transfer plan instead spreads the own block over the steps in
which this rank would wait for a peer (:meth:`TransferPlan.own_schedule`), so that it fills
those waits: each such step computes exactly its share, the block cut by query rows only
where a share ends inside a piece. Each step's pieces (see
:mod:`ringray.attention.pieces`) go to the local kernel and merge into float32 (out, LSE)
accumulators with the online-softmax rule. A backend with the fused ring-step capability
(:class:`~ringray.attention.backends.FusedStepBackend`, e.g. ``triton``) instead gets the
whole block pair with its global positions, once per step, and merges inside its kernel;
its backward gets ``delta = rowsum(dO * O)``, computed once per call, and adds into the
float32 gradient accumulators.

Backward: the rounds in reverse (the own block spread the same way where the plan says so).
It starts with the block the forward received last (kept
from the forward: not sent again) and ends with the own block, so the float32 dK/dV partial
sum of the last block read travels back to its owner while the own block is computed; each
owner adds the sums its readers send back into its own dK/dV. The price is keeping the own
block and the forward's last received block alive until the backward (two blocks at the
kv-head count). A :class:`~ringray.attention.stats.RingStats` records the bytes sent per
step and, per call, the messages sent and skipped against the plain ring.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from ringray.attention.backends import BlockAttentionBackend, BlockPairKey, FusedStepBackend
from ringray.attention.backends.common import accumulation_dtype, backend_delta, upload
from ringray.attention.comm import (
    PendingExchange,
    Posting,
    RingComm,
    StepScheduler,
    StreamMark,
    step_scheduler,
)
from ringray.attention.documents import Documents
from ringray.attention.layouts import Layout
from ringray.attention.merge import merge_into
from ringray.attention.pieces import Piece, PieceKind, RankPlan, plan_rank, split_pieces
from ringray.attention.stats import NULL_TIMER, RingCallRecord, RingStats, StepTimer
from ringray.attention.transfer_plan import TransferPlan
from ringray.attention.transfers import plan_transfers
from ringray.attention.ulysses import (
    UlyssesComm,
    check_grid,
    heads_to_sequence,
    lse_to_sequence,
    sequence_to_heads,
)
from ringray.attention.validation import (
    CheckedCall,
    RingAgreement,
    agree_across_ranks,
    check_local,
)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    ulysses_group: dist.ProcessGroup | None = None,
    layout: str | Layout | list[list[int]] = "zigzag",
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str | BlockAttentionBackend = "auto",
    return_lse: bool = False,
    stats: RingStats | None = None,
    documents: Documents | list[int] | None = None,
    window: int | None = None,
    transfers: str = "mask",
    agreement: RingAgreement | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact (causal) attention of this rank's queries over the whole ring's keys.

    Args:
        q: ``(batch, local_seq, q_heads, head_dim)``.
        k, v: ``(batch, local_seq, kv_heads, head_dim)``; ``q_heads % kv_heads == 0``.
        group: the context-parallel process group; ``None`` is the default group (or a
            single process when ``torch.distributed`` is not initialised). With
            ``ulysses_group``, the ring: the R ranks that share this rank's ulysses index.
        ulysses_group: the U ranks (consecutive global ranks, one node) that exchange heads
            around the ring; global rank = ring_index * U + ulysses_index. ``q_heads`` must
            split over U, and kv_heads split over U or divide it (K/V are then repeated).
            ``None`` (or one rank): no Ulysses.
        layout: ``"zigzag"``, ``"striped"``, ``"contiguous"``, ``"balanced"`` or
            ``"whole"`` (both built for ``documents``), a :class:`Layout`, or one list of
            global positions per rank.
            With Ulysses: a name, a grid layout (``make_layout(..., ulysses=U)``), or the
            ring's R-rank layout or position lists.
        causal: apply ``q_pos >= k_pos`` on global positions.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        backend: local kernel: ``"auto"``, ``"routed"``, ``"triton"``, ``"sdpa"`` or
            ``"reference"``, or a backend resolved once
            (:func:`~ringray.attention.backends.resolve_backend`) so that what it learns
            (``auto``'s measured kernel choices) lasts across calls.
        return_lse: also return the natural-log LSE, ``(batch, q_heads, local_seq)``
            float32 (not differentiable).
        stats: a :class:`RingStats` that receives one record per ring step (and one per
            Ulysses all-to-all).
        documents: the document lengths of the *global* sequence (positive, summing to
            ``local_seq`` times all ranks, identical on every rank, shared by every row):
            a query sees only keys of its own document (causal within it, or all of it when
            ``causal=False``). ``None``: one document.
        window: a sliding window (needs ``causal``): a query sees keys at most ``window - 1``
            positions before it (``window=1``: only itself). ``None``, or a window as long
            as the sequence: no window.
        transfers: ``"mask"`` (the default): a K/V block goes only to the ranks whose
            queries see some of its keys, and only those rows (:mod:`.transfers`).
            ``"all"``: every block goes whole to every rank, as a plain ring relays it
            (the same result; a baseline for ``ringray bench ring --transfers``).
        agreement: a :class:`~ringray.attention.validation.RingAgreement` kept for one ring
            context: the ranks agree on each call signature once, and calls with a
            signature agreed before make no all-reduce. ``None``: every call agrees.

    Raises:
        ValueError: on a bad argument (naming it), or when another rank of the ring (or
            of the ring x Ulysses grid) rejected its inputs. Raised before any K/V block or
            all-to-all is sent.
    """
    comm = RingComm(group)
    grid = UlyssesComm(ulysses_group) if ulysses_group is not None else None
    if grid is not None and grid.world_size == 1:
        grid = None  # a Ulysses group of one rank exchanges nothing
    checked: CheckedCall | None = None
    error: ValueError | None = None
    try:
        if grid is not None:
            check_grid(comm, grid)
        checked = check_local(q, k, v, comm, layout, causal, softmax_scale, backend,
                              documents, ulysses=grid.world_size if grid is not None else 1,
                              window=window, transfers=transfers)
    except ValueError as exc:
        error = exc
    if agreement is None or checked is None or checked.signature not in agreement.signatures:
        agree_across_ranks(comm, checked, error, grid)
        if agreement is not None and checked is not None:
            agreement.signatures.add(checked.signature)
    if error is not None:
        raise error
    if grid is not None:  # this rank's positions, all heads -> the ring member's chunk
        q, k, v = sequence_to_heads(q, k, v, grid, stats)
    out, lse = _RingAttention.apply(
        q, k, v, comm, checked.layout.ring, causal, checked.scale, checked.kernel, stats,
        checked.documents, checked.window, checked.transfers == "all",
    )
    if grid is not None:
        out = heads_to_sequence(out, grid, stats)
        lse = lse_to_sequence(lse, grid, stats) if return_lse else lse
    return (out, lse) if return_lse else out


@lru_cache(maxsize=64)  # plans are pure functions of immutable layouts (and documents)
def _plan(layout: Layout, rank: int, causal: bool, documents: Documents | None,
          window: int | None) -> RankPlan:
    return plan_rank(layout, rank, causal, documents, window)


@lru_cache(maxsize=64)
def _transfers(layout: Layout, causal: bool, documents: Documents | None,
               window: int | None, every_block: bool = False) -> TransferPlan:
    return plan_transfers(layout, causal, documents, window, every_block=every_block)


def _kernel_args(piece: Piece, call: RingCall, k_rank: int) -> dict:
    """A planned piece's keyword arguments for the kernel: its kind, and for a MASKED piece
    the mask's tokens (global positions, document indices) and rule (causal, window)."""
    mask = {}
    if piece.kind is PieceKind.MASKED:
        layout, documents = call.layout, call.documents
        q_pos = layout.positions(call.comm.rank)[piece.q_start : piece.q_end]
        k_pos = layout.positions(k_rank)[piece.k_start : piece.k_end]
        mask = {"q_pos": q_pos, "k_pos": k_pos, "causal": call.causal, "window": call.window}
        if documents is not None:
            mask.update(q_doc=documents.ids[q_pos], k_doc=documents.ids[k_pos])
    return {"kind": piece.kind, **mask}


@lru_cache(maxsize=16)
def _device_tokens(
    layout: Layout, documents: Documents | None, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """Every rank's global positions and document indices (``None`` without documents) as
    int32 on ``device``, for a fused-step backend. Cached: layouts are immutable (and
    memoised by ``make_layout``) and documents hashable, so a training step's layers and
    recomputations reuse one copy instead of moving them host to device per call."""
    ranks = range(layout.world_size)
    positions = tuple(upload(layout.positions(r), device, torch.int32) for r in ranks)
    if documents is None:
        return positions, (None,) * layout.world_size
    doc_ids = tuple(upload(documents.ids[layout.positions(r)], device, torch.int32)
                    for r in ranks)
    return positions, doc_ids


@lru_cache(maxsize=256)
def _row_index(layout: Layout, causal: bool, documents: Documents | None,
               window: int | None, source: int, reader: int,
               device: torch.device) -> torch.Tensor:
    """The local rows of ``source``'s block that ``reader`` reads, as an int64 index on
    ``device`` (cached like the plans: a step's layers share one copy)."""
    rows = _transfers(layout, causal, documents, window).rows_read(source, reader)
    index = torch.cat([torch.arange(start, end) for start, end in rows])
    return upload(index, device)


@lru_cache(maxsize=64)
def _row_indices(layout: Layout, causal: bool, documents: Documents | None,
                 window: int | None, every_block: bool, rank: int,
                 device: torch.device) -> dict[tuple[int, int], torch.Tensor]:
    """Every row index ``rank``'s partial transfers use, by ``(source, reader)``: the rows
    each reader reads of ``rank``'s block, and the rows ``rank`` reads of each other block.
    A call takes them all when it starts, on the compute stream and before its own-block
    mark, so a posting that gathers rows (on CUDA, on a side stream that waits for that
    mark) never reads an index still being uploaded. Cached like the plans: do not modify."""
    plan = _transfers(layout, causal, documents, window, every_block)
    indices = {}
    for other in range(layout.world_size):
        for pair in ((rank, other), (other, rank)):
            if other != rank and plan.is_partial(*pair):
                indices[pair] = _row_index(layout, causal, documents, window, *pair, device)
    return indices


def _index(call: RingCall, source: int, reader: int) -> torch.Tensor:
    return call.row_index[source, reader]


def _rows_out(call: RingCall, block: torch.Tensor, source: int, reader: int,
              post: Posting) -> torch.Tensor:
    """What travels between ``source`` and ``reader`` for ``block`` (``source``'s K/V block
    or the reader's dK/dV sum of it, rows on dim 3): the rows the reader reads, gathered
    into one contiguous tensor (in ``post``, where the step is posted), or the whole block
    when it reads every row."""
    if not call.transfers.is_partial(source, reader):
        return block
    return post.made(block.index_select(3, _index(call, source, reader)))


def _rows_in_buffer(call: RingCall, buffers: _Buffers, source: int, reader: int,
                    post: Posting) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor, buffer)``: a tensor to receive what :func:`_rows_out` sends in ``post``,
    and the pool buffer it lives in (to give back once used): the buffer itself when the
    whole block travels, else a contiguous view of its first elements shaped for the rows
    read."""
    buffer = buffers.take(post)
    if not call.transfers.is_partial(source, reader):
        return buffer, buffer
    shape = (*buffer.shape[:3], call.transfers.row_count(source, reader), *buffer.shape[4:])
    return buffer.view(-1)[:math.prod(shape)].view(shape), buffer


def _kv_received(call: RingCall, received: torch.Tensor, buffer: torch.Tensor,
                 buffers: _Buffers, source: int) -> torch.Tensor:
    """The K/V block of ``source`` from what arrived in ``buffer``: as is when whole, else
    its rows placed into another pool buffer, and ``buffer`` given back. The rows nobody
    here reads keep whatever finite values that buffer held (pool buffers are made zeroed
    and only ever hold K/V values); every mask multiplies them by zero."""
    if not call.transfers.is_partial(source, call.comm.rank):
        return received
    block = buffers.take()
    block.index_copy_(3, _index(call, source, call.comm.rank), received)
    buffers.give(buffer)
    return block


def _timer(stats: RingStats | None, device: torch.device) -> StepTimer:
    return stats.timer(device) if stats is not None else NULL_TIMER


def _finish_step(
    stats: RingStats | None, phase: str, step: int, timer: StepTimer,
    pending: PendingExchange | None,
) -> None:
    timer.end_compute()
    if pending is not None:
        pending.wait()
    timer.end_wait()
    if stats is not None:
        stats.add(phase, step, timer, pending.bytes_sent if pending is not None else 0)


@dataclass(frozen=True, kw_only=True)
class RingCall:
    """One ring-attention call's fixed parts, shared by its forward and backward: the ring,
    the mask, the kernel, and the plans of what this rank computes and sends."""

    comm: RingComm
    layout: Layout
    causal: bool
    scale: float
    kernel: BlockAttentionBackend
    stats: RingStats | None
    kv_dtype: torch.dtype
    positions: tuple[torch.Tensor, ...] | None  # per rank, on the device (fused kernels)
    doc_ids: tuple[torch.Tensor | None, ...] | None
    documents: Documents | None
    window: int | None
    plan: RankPlan
    transfers: TransferPlan
    every_block: bool  # transfers="all": every block whole to every rank
    # the rows of each partial transfer this rank sends or receives (_row_indices)
    row_index: dict[tuple[int, int], torch.Tensor] = field(compare=False)

    @property
    def fused(self) -> FusedStepBackend | None:
        return self.kernel if isinstance(self.kernel, FusedStepBackend) else None


# Message tags: one per kind, so a K/V block and a dK/dV sum between the same two ranks in
# one round cannot be confused (RingComm.post lists them in this order on both sides).
_KV_TAG, _DKV_TAG = 0, 1


class _Buffers:
    """Reusable tensors shaped like ``template``, made on first need: on CPU at most as many
    exist as are in use at once (two K/V receive buffers, two dK/dV sums).

    A tensor given back carries the scheduler's mark after its last use
    (:meth:`StepScheduler.mark`), and whoever takes it next waits for that mark. A receive
    (a take inside a posting) takes the oldest tensor the scheduler lets it reuse without
    waiting for the previous step's compute (:meth:`StepScheduler.reusable`; on CUDA that
    keeps one tensor more in the pool, and lets receives run a step ahead); the compute
    takes the newest."""

    def __init__(self, template: torch.Tensor, dtype: torch.dtype,
                 scheduler: StepScheduler) -> None:
        self._template, self._dtype, self._scheduler = template, dtype, scheduler
        self._free: list[tuple[torch.Tensor, StreamMark | None]] = []

    def take(self, post: Posting | None = None) -> torch.Tensor:
        """A free tensor, or a new one (zeros: a K/V block that gets only some rows keeps
        the others' values, which must be finite; a reused one holds earlier values);
        ``post``: the posting it receives in (else the compute uses it)."""
        if post is None:
            if self._free:
                tensor, mark = self._free.pop()
                self._scheduler.compute_after(mark)
                return tensor
            return self._new()
        for i, (tensor, mark) in enumerate(self._free):
            if self._scheduler.reusable(mark):
                del self._free[i]
                post.after(mark)
                return tensor
        return post.made(self._new())

    def give(self, tensor: torch.Tensor, post: Posting | None = None) -> None:
        """Take ``tensor`` back once what is enqueued so far (on the compute stream, or in
        ``post``) is done with it."""
        where = post if post is not None else self._scheduler
        self._free.append((tensor, where.mark("free", tensor)))

    def _new(self) -> torch.Tensor:
        return torch.zeros(self._template.shape, dtype=self._dtype,
                           device=self._template.device)


class _OwnBlock:
    """When this rank computes its own block in one phase. ``None`` from
    :meth:`TransferPlan.own_schedule`: all of it at its classic step (``spread`` is False).
    Otherwise :meth:`due` gives, at each step, the part of the block the schedule puts there
    (:func:`_own_steps`: cut once per cached plan, only where the schedule needs a cut)."""

    def __init__(self, call: RingCall, phase: str) -> None:
        self._steps = _own_steps(call.layout, call.comm.rank, call.causal, call.documents,
                                 call.window, call.every_block, phase,
                                 call.fused is not None)
        self.spread = self._steps is not None

    def due(self, index: int) -> tuple[tuple[Piece, ...] | None, ...]:
        """The units to compute at step ``index`` (``None``: the whole block, fused)."""
        return self._steps[index] if self._steps is not None else ()


@lru_cache(maxsize=256)
def _own_steps(layout: Layout, rank: int, causal: bool, documents: Documents | None,
               window: int | None, every_block: bool, phase: str,
               fused: bool) -> tuple[tuple[tuple[Piece, ...] | None, ...], ...] | None:
    """Per step of ``rank``'s steps in ``phase``, the units of its own block to compute
    there, or ``None`` when the block keeps its classic place. A step gets one unit holding
    exactly its share of the schedule's pairs (:func:`split_pieces`: a piece is cut only
    where a share ends inside it, so a block spread over k steps makes at most 2 (k - 1)
    more kernel calls than the block whole), or nothing. A fused backend computes the block
    in one call: at the first step by which the schedule has done half of it. Cached like
    the plans, so a ring call plans nothing."""
    plan = _transfers(layout, causal, documents, window, every_block)
    schedule = plan.own_schedule(rank, phase)
    if schedule is None or schedule[-1] <= 0:
        return None
    if fused:
        half = next(i for i, done in enumerate(schedule) if 2 * done >= schedule[-1])
        return tuple((None,) if i == half else () for i in range(len(schedule)))
    shares = [done - before for before, done in itertools.pairwise((0, *schedule))]
    at = [i for i, share in enumerate(shares) if share > 0]
    units = split_pieces(_plan(layout, rank, causal, documents, window).pieces[rank],
                         [shares[i] for i in at])
    steps: list[tuple[tuple[Piece, ...], ...]] = [()] * len(schedule)
    for i, unit in zip(at, units, strict=True):
        steps[i] = (unit,) if unit else ()
    return tuple(steps)


def _record_call(call: RingCall, phase: str, kv_bytes: int, dkv_bytes: int,
                 sent_bytes: int) -> None:
    """One :class:`RingCallRecord` for this rank's phase: what it sent and what the plain
    ring would have sent on top."""
    if call.stats is None:
        return
    counts = call.transfers.counts(call.comm.rank)
    if phase == "forward":
        sent, skipped = counts.forward_kv, counts.forward_skipped
        ring_bytes = counts.ring_forward * kv_bytes
    else:
        sent, skipped = counts.backward_kv + counts.backward_dkv, counts.backward_skipped
        ring_bytes = counts.ring_forward * (kv_bytes + dkv_bytes)
    call.stats.add_call(RingCallRecord(phase=phase, transfers=sent, transfers_skipped=skipped,
                                       bytes_sent=sent_bytes,
                                       bytes_skipped=ring_bytes - sent_bytes))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: RingComm, layout: Layout, causal: bool, scale: float,
                kernel: BlockAttentionBackend, stats: RingStats | None,
                documents: Documents | None, window: int | None, every_block: bool = False):
        rank = comm.rank
        fused = isinstance(kernel, FusedStepBackend)
        positions, doc_ids = (_device_tokens(layout, documents, q.device) if fused
                              else (None, None))
        call = RingCall(comm=comm, layout=layout, causal=causal, scale=scale, kernel=kernel,
                        stats=stats, kv_dtype=k.dtype, positions=positions, doc_ids=doc_ids,
                        documents=documents, window=window,
                        plan=_plan(layout, rank, causal, documents, window),
                        transfers=_transfers(layout, causal, documents, window, every_block),
                        every_block=every_block,
                        row_index=_row_indices(layout, causal, documents, window, every_block,
                                               rank, q.device))
        acc = accumulation_dtype(q.dtype)
        batch, seq, q_heads, head_dim = q.shape
        q_t = q.transpose(1, 2)
        # K and V travel together as one contiguous (2, B, kv_heads, S, D) buffer; the own
        # block is sent to every reader and kept for the backward.
        kv_own = torch.stack((k.transpose(1, 2), v.transpose(1, 2)))
        scheduler = step_scheduler(q.device)
        # Every step's send of the own block waits for this alone (on CUDA), not for the
        # compute enqueued before its posting; the backward's sends wait for it too.
        own_ready = scheduler.mark("own")
        kv_buffers = _Buffers(kv_own, kv_own.dtype, scheduler)
        held = {rank: kv_own}  # K/V blocks on hand, by the rank they started on
        out = torch.zeros(batch, q_heads, seq, head_dim, dtype=acc, device=q.device)
        lse = torch.full((batch, q_heads, seq), float("-inf"), dtype=acc, device=q.device)
        touched = torch.zeros(seq, dtype=torch.bool)  # rows that hold a partial result yet
        sent_bytes, last = 0, None
        own = _OwnBlock(call, "forward")

        for index, step in enumerate(call.transfers.forward_steps(rank)):
            timer = _timer(stats, q.device)
            pending, incoming = None, None
            if step.exchange is not None:
                exchange = step.exchange
                with scheduler.posting() as post:
                    send, recv = [], []
                    if exchange.kv_to is not None:
                        post.after(own_ready)
                        send.append((_rows_out(call, kv_own, rank, exchange.kv_to, post),
                                     exchange.kv_to, _KV_TAG))
                    if exchange.kv_from is not None:
                        incoming, incoming_buffer = _rows_in_buffer(
                            call, kv_buffers, exchange.kv_from, rank, post)
                        recv.append((incoming, exchange.kv_from, _KV_TAG))
                    pending = post.exchange(comm, send, recv)
            timer.start_compute()
            if step.block is not None and not (own.spread and step.block == rank):
                kv_block = held.pop(step.block) if step.block != rank else kv_own
                _forward_block(call, step.block, q_t, kv_block, out, lse, touched)
                if step.block != rank:
                    last = (step.block, kv_block)
                    kv_buffers.give(kv_block)  # the forward receives nothing after its last
            for unit in own.due(index):
                if unit is None:
                    _forward_block(call, rank, q_t, kv_own, out, lse, touched)
                else:
                    _forward_pieces(call, rank, q_t, kv_own, out, lse, touched, unit)
            _finish_step(stats, "forward", index, timer, pending)
            if pending is not None:
                sent_bytes += pending.bytes_sent
            if incoming is not None:
                source = step.exchange.kv_from
                held[source] = _kv_received(call, incoming, incoming_buffer, kv_buffers,
                                            source)

        result = out.to(q.dtype).transpose(1, 2).contiguous()
        last_source, kv_last = last if last is not None else (None, None)
        ctx.save_for_backward(q, result, lse, kv_own, kv_last)
        ctx.call, ctx.last_source, ctx.own_ready = call, last_source, own_ready
        ctx.mark_non_differentiable(lse)
        kv_bytes = kv_own.numel() * kv_own.element_size()
        _record_call(call, "forward", kv_bytes, 0, sent_bytes)
        return result, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, kv_own, kv_last = ctx.saved_tensors
        call: RingCall = ctx.call
        comm, stats, rank = call.comm, call.stats, call.comm.rank
        acc = accumulation_dtype(q.dtype)
        q_t, out_t, dout_t = q.transpose(1, 2), out.transpose(1, 2), dout.transpose(1, 2)
        dq = torch.zeros(q_t.shape, dtype=acc, device=q.device)
        # The own block's dK/dV: its own step adds into it, and every reader's sum comes back.
        dkv_own = torch.zeros(kv_own.shape, dtype=acc, device=q.device)
        scheduler = step_scheduler(q.device)
        own_ready = ctx.own_ready  # the forward's: the own block has not changed since
        kv_buffers = _Buffers(kv_own, kv_own.dtype, scheduler)
        dkv_buffers = _Buffers(kv_own, acc, scheduler)
        held = {ctx.last_source: kv_last} if ctx.last_source is not None else {}
        # dK/dV sums computed, not yet sent back, each with the mark after its compute
        done: dict[int, tuple[torch.Tensor, StreamMark | None]] = {}
        # Once per call, by the fused backend's own kernel where it has one.
        delta = backend_delta(call.fused, dout_t, out_t) if call.fused is not None else None
        sent_bytes = 0
        own = _OwnBlock(call, "backward")

        for index, step in enumerate(call.transfers.backward_steps(rank)):
            timer = _timer(stats, q.device)
            pending, incoming, returning, dkv_incoming = None, None, None, None
            if step.exchange is not None:
                exchange = step.exchange
                with scheduler.posting() as post:
                    send, recv = [], []
                    if exchange.kv_to is not None:
                        post.after(own_ready)
                        send.append((_rows_out(call, kv_own, rank, exchange.kv_to, post),
                                     exchange.kv_to, _KV_TAG))
                    if exchange.dkv_to is not None:
                        returning, sum_ready = done.pop(exchange.dkv_to)
                        post.after(sum_ready)
                        rows = _rows_out(call, returning, exchange.dkv_to, rank, post)
                        if rows is not returning:  # a copy of its rows: the sum is free
                            dkv_buffers.give(returning, post)  # once the copy is made
                            returning = None
                        send.append((rows, exchange.dkv_to, _DKV_TAG))
                    if exchange.kv_from is not None:
                        incoming, incoming_buffer = _rows_in_buffer(
                            call, kv_buffers, exchange.kv_from, rank, post)
                        recv.append((incoming, exchange.kv_from, _KV_TAG))
                    if exchange.dkv_from is not None:
                        dkv_incoming, dkv_buffer = _rows_in_buffer(
                            call, dkv_buffers, rank, exchange.dkv_from, post)
                        recv.append((dkv_incoming, exchange.dkv_from, _DKV_TAG))
                    pending = post.exchange(comm, send, recv)
            timer.start_compute()
            if step.block == rank:  # the own block, last: its sum is dK/dV's accumulator
                if not own.spread:
                    _backward_block(call, rank, dout_t, q_t, kv_own, out_t, lse, delta, dq,
                                    dkv_own)
            elif step.block is not None:
                kv_block = held.pop(step.block)
                partial = dkv_buffers.take().zero_()
                _backward_block(call, step.block, dout_t, q_t, kv_block, out_t, lse, delta,
                                dq, partial)
                done[step.block] = (partial, scheduler.mark(f"sum {step.block}"))
                if kv_block is not kv_last:  # a saved tensor stays as saved (retain_graph)
                    kv_buffers.give(kv_block)
            for unit in own.due(index):
                if unit is None:
                    _backward_block(call, rank, dout_t, q_t, kv_own, out_t, lse, delta, dq,
                                    dkv_own)
                else:
                    _backward_pieces(call, rank, dout_t, q_t, kv_own, out_t, lse, dq,
                                     dkv_own, unit)
            _finish_step(stats, "backward", index, timer, pending)
            if pending is not None:
                sent_bytes += pending.bytes_sent
            if incoming is not None:
                source = step.exchange.kv_from
                held[source] = _kv_received(call, incoming, incoming_buffer, kv_buffers,
                                            source)
            if returning is not None:
                dkv_buffers.give(returning)
            if dkv_incoming is not None:
                reader = step.exchange.dkv_from
                if call.transfers.is_partial(rank, reader):  # only the rows it read
                    dkv_own.index_add_(3, _index(call, rank, reader), dkv_incoming)
                else:
                    dkv_own += dkv_incoming
                dkv_buffers.give(dkv_buffer)

        dk = dkv_own[0].transpose(1, 2).to(call.kv_dtype)
        dv = dkv_own[1].transpose(1, 2).to(call.kv_dtype)
        kv_bytes = kv_own.numel() * kv_own.element_size()
        _record_call(call, "backward", kv_bytes, dkv_own.numel() * dkv_own.element_size(),
                     sent_bytes)
        return (dq.transpose(1, 2).to(q.dtype), dk, dv,
                None, None, None, None, None, None, None, None, None)


def _forward_block(call: RingCall, source: int, q_t: torch.Tensor, kv_block: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, touched: torch.Tensor) -> None:
    """Attend this rank's queries to the K/V block that started on ``source`` and merge the
    result into ``(out, lse)``: one fused call, or a kernel call per planned piece."""
    rank, layout, documents = call.comm.rank, call.layout, call.documents
    if call.fused is not None:
        call.fused.forward_into(
            q_t, kv_block[0], kv_block[1], out, lse, causal=call.causal, scale=call.scale,
            q_pos=call.positions[rank], k_pos=call.positions[source],
            q_doc=call.doc_ids[rank], k_doc=call.doc_ids[source],
            key=BlockPairKey(layout, rank, source, documents), window=call.window,
        )
    else:
        _forward_pieces(call, source, q_t, kv_block, out, lse, touched)


def _backward_block(call: RingCall, source: int, dout_t: torch.Tensor, q_t: torch.Tensor,
                    kv_block: torch.Tensor, out_t: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor | None, dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """Add the gradients of this rank's queries against ``source``'s K/V block to ``dq``
    and to ``dkv`` (that block's dK/dV)."""
    rank, layout, documents = call.comm.rank, call.layout, call.documents
    if call.fused is not None:
        call.fused.backward_into(
            dout_t, q_t, kv_block[0], kv_block[1], lse, delta, dq, dkv[0], dkv[1],
            causal=call.causal, scale=call.scale,
            q_pos=call.positions[rank], k_pos=call.positions[source],
            q_doc=call.doc_ids[rank], k_doc=call.doc_ids[source],
            key=BlockPairKey(layout, rank, source, documents), window=call.window,
        )
    else:
        _backward_pieces(call, source, dout_t, q_t, kv_block, out_t, lse, dq, dkv)


def _forward_pieces(
    call: RingCall, source: int, q_t: torch.Tensor, kv_block: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, touched: torch.Tensor,
    pieces: tuple[Piece, ...] | None = None,
) -> None:
    """One forward step through the plain backend interface: a call per planned piece (or
    per piece of ``pieces``, a unit of the block)."""
    for piece in call.plan.pieces[source] if pieces is None else pieces:
        rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
        block_out, block_lse = call.kernel.forward(
            q_t[:, :, rows], kv_block[0][:, :, keys], kv_block[1][:, :, keys],
            scale=call.scale, **_kernel_args(piece, call, source),
        )
        # Rows not touched yet hold out 0 and lse -inf, which merge exactly; a piece whose
        # rows are all untouched is copied instead. Either way its rows are touched after.
        if touched[rows].any():
            merge_into(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        else:  # first result for these rows: nothing to merge with
            out[:, :, rows] = block_out
            lse[:, :, rows] = block_lse
        touched[rows] = True


def _backward_pieces(
    call: RingCall, source: int, dout_t: torch.Tensor, q_t: torch.Tensor,
    kv_block: torch.Tensor, out_t: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor,
    dkv: torch.Tensor, pieces: tuple[Piece, ...] | None = None,
) -> None:
    """One backward step through the plain backend interface: a call per planned piece (or
    per piece of ``pieces``, a unit of the block)."""
    for piece in call.plan.pieces[source] if pieces is None else pieces:
        rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
        dq_piece, dk_piece, dv_piece = call.kernel.backward(
            dout_t[:, :, rows], q_t[:, :, rows],
            kv_block[0][:, :, keys], kv_block[1][:, :, keys],
            out_t[:, :, rows], lse[:, :, rows],
            scale=call.scale, **_kernel_args(piece, call, source),
        )
        dq[:, :, rows] += dq_piece
        dkv[0][:, :, keys] += dk_piece
        dkv[1][:, :, keys] += dv_piece
