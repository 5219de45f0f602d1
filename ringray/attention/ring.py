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

Ulysses × ring: ``ulysses_group=`` adds an inner head all-to-all (one node) around the ring
(across nodes); ``group`` is then the ring of ranks sharing this rank's ulysses index, and
the layout covers the whole grid (``make_layout(kind, R * U, S, ulysses=U)``). See
:mod:`ringray.attention.ulysses`.

Forward: at step t this rank holds the K/V block that started on rank (r - t) mod N. The
next block's send/receive is posted before the step's compute and waited for after it, so
the transfer hides behind the compute. Each step's pieces (see
:mod:`ringray.attention.steps`) go to the local kernel and merge into float32 (out, LSE)
accumulators with the online-softmax rule. A backend with the fused ring-step capability
(:class:`~ringray.attention.backends.FusedStepBackend`, e.g. ``triton``) instead gets the
whole block pair with its global positions, once per step, and merges inside its kernel;
its backward gets ``delta = rowsum(dO * O)``, computed once per call, and adds into the
float32 gradient accumulators.

Backward: the forward ends holding block r + 1, and the backward starts there, rotating K/V
the *other* way (receive from r + 1, send to r - 1): at step t it holds block (r + 1 + t)
mod N, so the last step is this rank's own block. Each block's float32 dK/dV partial sum
travels with it and, after N steps, is complete on its owner, so there is no final
"return the gradients" hop left exposed after the last compute. The price is keeping the
forward's last K/V block alive until the backward (one block at the kv-head count).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from ringray.attention.backends import BlockAttentionBackend, BlockPairKey, FusedStepBackend
from ringray.attention.backends.common import accumulation_dtype, softmax_delta, upload
from ringray.attention.comm import PendingExchange, RingComm
from ringray.attention.documents import Documents
from ringray.attention.layouts import Layout
from ringray.attention.merge import merge_into
from ringray.attention.stats import NULL_TIMER, RingStats, StepTimer
from ringray.attention.steps import Piece, PieceKind, RankPlan, plan_rank
from ringray.attention.ulysses import (
    UlyssesComm,
    check_grid,
    heads_to_sequence,
    lse_to_sequence,
    sequence_to_heads,
)
from ringray.attention.validation import CheckedCall, agree_across_ranks, check_local


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
    backend: str = "auto",
    return_lse: bool = False,
    stats: RingStats | None = None,
    documents: Documents | list[int] | None = None,
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
        layout: ``"zigzag"``, ``"striped"``, ``"contiguous"``, ``"balanced"`` (built for
            ``documents``), a :class:`Layout`, or one list of global positions per rank.
            With Ulysses: a name, a grid layout (``make_layout(..., ulysses=U)``), or the
            ring's R-rank layout or position lists.
        causal: apply ``q_pos >= k_pos`` on global positions.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        backend: local kernel: ``"auto"``, ``"triton"``, ``"sdpa"`` or ``"reference"``.
        return_lse: also return the natural-log LSE, ``(batch, q_heads, local_seq)``
            float32 (not differentiable).
        stats: a :class:`RingStats` that receives one record per ring step (and one per
            Ulysses all-to-all).
        documents: the document lengths of the *global* sequence (positive, summing to
            ``local_seq`` times all ranks, identical on every rank, shared by every row):
            a query sees only keys of its own document (causal within it, or all of it when
            ``causal=False``). ``None``: one document.

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
                              documents, ulysses=grid.world_size if grid is not None else 1)
    except ValueError as exc:
        error = exc
    agree_across_ranks(comm, checked, error, grid)
    if error is not None:
        raise error
    if grid is not None:  # this rank's positions, all heads -> the ring member's chunk
        q, k, v = sequence_to_heads(q, k, v, grid, stats)
    out, lse = _RingAttention.apply(
        q, k, v, comm, checked.layout.ring, causal, checked.scale, checked.kernel, stats,
        checked.documents,
    )
    if grid is not None:
        out = heads_to_sequence(out, grid, stats)
        lse = lse_to_sequence(lse, grid, stats) if return_lse else lse
    return (out, lse) if return_lse else out


@lru_cache(maxsize=64)  # plans are pure functions of immutable layouts (and documents)
def _plan(layout: Layout, rank: int, causal: bool, documents: Documents | None) -> RankPlan:
    return plan_rank(layout, rank, causal, documents)


def _kernel_args(piece: Piece, layout: Layout, q_rank: int, k_rank: int,
                 documents: Documents | None, causal: bool) -> dict:
    mask = {}
    if piece.kind is PieceKind.MASKED:
        q_pos = layout.positions(q_rank)[piece.q_start : piece.q_end]
        k_pos = layout.positions(k_rank)[piece.k_start : piece.k_end]
        mask = {"q_pos": q_pos, "k_pos": k_pos}
        if documents is not None:
            mask.update(causal=causal, q_doc=documents.ids[q_pos], k_doc=documents.ids[k_pos])
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
    """What the backward of a ring-attention call needs from its forward besides the saved
    tensors: the ring, the mask and the kernel that ran it."""

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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: RingComm, layout: Layout, causal: bool, scale: float,
                kernel: BlockAttentionBackend, stats: RingStats | None,
                documents: Documents | None):
        rank, world = comm.rank, comm.world_size
        plan = _plan(layout, rank, causal, documents)
        acc = accumulation_dtype(q.dtype)
        batch, seq, q_heads, head_dim = q.shape
        q_t = q.transpose(1, 2)
        # K and V travel together as one contiguous (2, B, kv_heads, S, D) buffer.
        kv_block = torch.stack((k.transpose(1, 2), v.transpose(1, 2)))
        kv_incoming = torch.empty_like(kv_block) if world > 1 else None
        out = torch.zeros(batch, q_heads, seq, head_dim, dtype=acc, device=q.device)
        lse = torch.full((batch, q_heads, seq), float("-inf"), dtype=acc, device=q.device)
        touched = torch.zeros(seq, dtype=torch.bool)  # rows that hold a partial result yet
        fused = kernel if isinstance(kernel, FusedStepBackend) else None
        positions, doc_ids = (_device_tokens(layout, documents, q.device) if fused is not None
                              else (None, None))

        for step in range(world):
            source = (rank - step) % world
            timer = _timer(stats, q.device)
            pending = comm.exchange([kv_block], [kv_incoming]) if step < world - 1 else None
            timer.start_compute()
            if fused is not None:
                if plan.pieces[source]:  # the plan knows when no query sees any key
                    fused.forward_into(
                        q_t, kv_block[0], kv_block[1], out, lse, causal=causal, scale=scale,
                        q_pos=positions[rank], k_pos=positions[source],
                        q_doc=doc_ids[rank], k_doc=doc_ids[source],
                        key=BlockPairKey(layout, rank, source, documents),
                    )
            else:
                _forward_pieces(kernel, plan.pieces[source], q_t, kv_block, out, lse, touched,
                                scale, layout, rank, source, documents, causal)
            _finish_step(stats, "forward", step, timer, pending)
            if pending is not None:
                kv_block, kv_incoming = kv_incoming, kv_block

        result = out.to(q.dtype).transpose(1, 2).contiguous()
        ctx.save_for_backward(q, result, lse, kv_block)
        ctx.call = RingCall(comm=comm, layout=layout, causal=causal, scale=scale, kernel=kernel,
                            stats=stats, kv_dtype=k.dtype, positions=positions,
                            doc_ids=doc_ids, documents=documents)
        ctx.mark_non_differentiable(lse)
        return result, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, kv_block = ctx.saved_tensors
        call: RingCall = ctx.call
        comm, layout, causal, scale = call.comm, call.layout, call.causal, call.scale
        kernel, stats, kv_dtype, documents = call.kernel, call.stats, call.kv_dtype, call.documents
        positions, doc_ids = call.positions, call.doc_ids
        rank, world = comm.rank, comm.world_size
        plan = _plan(layout, rank, causal, documents)
        acc = accumulation_dtype(q.dtype)
        q_t, out_t, dout_t = q.transpose(1, 2), out.transpose(1, 2), dout.transpose(1, 2)
        dq = torch.zeros(q_t.shape, dtype=acc, device=q.device)
        grad_shape = (2, *kv_block.shape[1:])
        # Zeroed at the start of each step; the two swap so one is sent while the other fills.
        dkv_partial = torch.empty(grad_shape, dtype=acc, device=q.device)  # block being done
        dkv_done = torch.empty_like(dkv_partial) if world > 1 else None  # previous block's
        dkv_incoming = torch.empty_like(dkv_partial) if world > 1 else None
        kv_spare = [torch.empty_like(kv_block), torch.empty_like(kv_block)] if world > 1 else []
        fused = kernel if isinstance(kernel, FusedStepBackend) else None
        delta = softmax_delta(dout_t, out_t) if fused is not None else None  # once per call

        for step in range(world):
            block = (rank + 1 + step) % world
            timer = _timer(stats, q.device)
            send, recv = [], []
            if step < world - 1:
                kv_next = kv_spare[step % 2]
                send.append(kv_block)
                recv.append(kv_next)
            if step > 0:  # hand the previous block's partial sum to the rank that needs it next
                send.append(dkv_done)
                recv.append(dkv_incoming)
            pending = comm.exchange(send, recv, reverse=True) if send else None
            timer.start_compute()
            dkv_partial.zero_()
            if fused is not None:
                if plan.pieces[block]:
                    fused.backward_into(
                        dout_t, q_t, kv_block[0], kv_block[1], lse, delta,
                        dq, dkv_partial[0], dkv_partial[1], causal=causal, scale=scale,
                        q_pos=positions[rank], k_pos=positions[block],
                        q_doc=doc_ids[rank], k_doc=doc_ids[block],
                        key=BlockPairKey(layout, rank, block, documents),
                    )
            else:
                _backward_pieces(kernel, plan.pieces[block], dout_t, q_t, kv_block, out_t, lse,
                                 dq, dkv_partial, scale, layout, rank, block, documents, causal)
            _finish_step(stats, "backward", step, timer, pending)
            if step > 0:
                dkv_partial += dkv_incoming
            if step < world - 1:
                kv_block = kv_next
            dkv_partial, dkv_done = (dkv_done, dkv_partial) if world > 1 else (dkv_partial, None)

        own = dkv_done if world > 1 else dkv_partial
        dk = own[0].transpose(1, 2).to(kv_dtype)
        dv = own[1].transpose(1, 2).to(kv_dtype)
        return (dq.transpose(1, 2).to(q.dtype), dk, dv,
                None, None, None, None, None, None, None)


def _forward_pieces(
    kernel: BlockAttentionBackend, pieces: tuple[Piece, ...], q_t: torch.Tensor,
    kv_block: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, touched: torch.Tensor,
    scale: float, layout: Layout, rank: int, source: int, documents: Documents | None,
    causal: bool,
) -> None:
    """One forward step through the plain backend interface: a call per planned piece."""
    for piece in pieces:
        rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
        block_out, block_lse = kernel.forward(
            q_t[:, :, rows], kv_block[0][:, :, keys], kv_block[1][:, :, keys],
            scale=scale, **_kernel_args(piece, layout, rank, source, documents, causal),
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
    kernel: BlockAttentionBackend, pieces: tuple[Piece, ...], dout_t: torch.Tensor,
    q_t: torch.Tensor, kv_block: torch.Tensor, out_t: torch.Tensor, lse: torch.Tensor,
    dq: torch.Tensor, dkv_partial: torch.Tensor, scale: float, layout: Layout, rank: int,
    block: int, documents: Documents | None, causal: bool,
) -> None:
    """One backward step through the plain backend interface: a call per planned piece."""
    for piece in pieces:
        rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
        dq_piece, dk_piece, dv_piece = kernel.backward(
            dout_t[:, :, rows], q_t[:, :, rows],
            kv_block[0][:, :, keys], kv_block[1][:, :, keys],
            out_t[:, :, rows], lse[:, :, rows],
            scale=scale, **_kernel_args(piece, layout, rank, block, documents, causal),
        )
        dq[:, :, rows] += dq_piece
        dkv_partial[0][:, :, keys] += dk_piece
        dkv_partial[1][:, :, keys] += dv_piece
