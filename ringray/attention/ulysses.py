"""Ulysses × ring: a head all-to-all inside a node around the ring across nodes.

DeepSpeed-Ulysses swaps a sequence shard for a head shard with one all-to-all, attends over
the whole sequence for H/U heads, and swaps back with a second all-to-all. USP (yunchang's
``LongContextAttention``) and TransformerEngine nest it inside the ring: Ulysses in the
inner dimension (U ranks on one node, fast links), the ring in the outer one (R ranks across
nodes). Here:

    ring_group, ulysses_group = grid_groups(ulysses=2)     # collective, once
    layout = make_layout("zigzag", world_size=4, seq_len=S, ulysses=2)
    q, k, v = (layout.shard(t, dist.get_rank()) for t in (q_all, k_all, v_all))
    out = ring_attention(q, k, v, ring_group, ulysses_group=ulysses_group, layout=layout)

Global rank ``g = ring_index * U + ulysses_index``: a Ulysses group is a run of U
consecutive ranks (so that placement keeps it on one node) and a ring is the R ranks that
share an ulysses index. The two-dimensional layout gives ring member r's chunk (the ring
layout's share of S/R positions, in its local order) to its Ulysses group as U consecutive
sub-shards (:func:`~ringray.attention.layouts.make_layout`). So:

1. one all-to-all (q, k and v packed together) gathers the group's sub-shards and scatters
   heads: every rank of the group then holds the member's whole chunk for H/U query heads;
2. the ring runs over R exactly as without Ulysses, with the same layout, documents, plan
   and kernels (each Ulysses index is its own ring, on its own heads);
3. one all-to-all brings the output back to the caller's positions with all heads (one
   more, of the float32 LSE, when it is asked for).

The backward is the mirror: the output's all-to-all becomes dout's (sequence to heads) and
the inputs' becomes dq/dk/dv's (heads to sequence), each an autograd Function whose backward
is the reverse all-to-all.

GQA: rank u of a group gets query heads ``[u * H/U, (u + 1) * H/U)``. When U divides the kv
heads it gets the kv heads those queries use; when the kv heads divide U (U > kv_heads, as
yunchang does), K and V are first repeated ``U / kv_heads`` times (``repeat_interleave``,
so autograd sums the copies' gradients back) and every rank gets the one kv head its queries
share. Any other combination is refused (:func:`check_ulysses_heads`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ringray.attention.comm import RingComm, agree_max
from ringray.attention.groups import RING_DIM, group_timeout, with_timeout
from ringray.attention.stats import IntervalTimer, RingStats


def check_ulysses_heads(q_heads: int, kv_heads: int, ulysses: int) -> int:
    """How many times K/V heads are repeated before the all-to-all (1: none); ``ValueError``
    when the heads cannot be shared over ``ulysses`` ranks. For option checks too."""
    if q_heads % ulysses:
        raise ValueError(
            f"q: {q_heads} query heads do not split over ulysses={ulysses} ranks; use a "
            f"multiple of {ulysses} query heads or a ulysses degree that divides {q_heads}"
        )
    if kv_heads % ulysses == 0:
        return 1
    if ulysses % kv_heads == 0:
        return ulysses // kv_heads
    raise ValueError(
        f"k: {kv_heads} kv heads neither split over nor replicate evenly onto ulysses="
        f"{ulysses} ranks; use a ulysses degree that divides {kv_heads} or is a multiple of it"
    )


class UlyssesComm:
    """This rank's view of its Ulysses group: index ``rank`` of ``world_size`` ranks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("ulysses_group: a process group was given but torch.distributed "
                             "is not initialised")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"ulysses_group: expected a torch.distributed ProcessGroup, got "
                             f"{type(group).__name__}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of a CPU int64 vector over the group, on its CPU side group
        (blocking, no device sync)."""
        return agree_max(values, self.group) if self.world_size > 1 else values

    def exchange(self, buffer: torch.Tensor) -> torch.Tensor:
        """All-to-all of ``buffer`` ``(U, ...)``: block j goes to rank j, and block i of the
        result came from rank i (blocking)."""
        received = torch.empty_like(buffer)
        dist.all_to_all_single(received, buffer, group=self.group)
        return received

    def bytes_sent(self, buffer: torch.Tensor) -> int:
        """What leaves this rank when ``buffer`` is exchanged (its own block stays)."""
        return buffer.numel() * buffer.element_size() * (self.world_size - 1) // self.world_size


def check_grid(ring: RingComm, ulysses: UlyssesComm) -> None:
    """``ValueError`` unless the ring and Ulysses groups form the grid ``ring_index * U +
    ulysses_index`` around this rank (a local check: it reads the groups' rank lists)."""
    me = dist.get_rank()
    world = dist.get_world_size()
    ring_ranks = (dist.get_process_group_ranks(ring.group) if ring.group is not None
                  else list(range(world)))
    ulysses_ranks = dist.get_process_group_ranks(ulysses.group)
    if me not in ulysses_ranks:
        raise ValueError(f"ulysses_group: this rank ({me}) is not one of its ranks "
                         f"{ulysses_ranks}")
    size = ulysses.world_size
    first = ulysses_ranks[0]
    if ulysses_ranks != list(range(first, first + size)):
        raise ValueError(
            f"ulysses_group: its ranks {ulysses_ranks} are not consecutive; ranks are numbered "
            f"ring_index x {size} + ulysses_index, so a Ulysses group is a run of {size} "
            f"consecutive ranks"
        )
    want = [first - ring.rank * size + j * size + ulysses.rank for j in range(ring.world_size)]
    if ring_ranks != want:
        raise ValueError(
            f"group: the ring's ranks {ring_ranks} should be {want}, the ranks that share "
            f"this rank's ulysses index {ulysses.rank} (rank = ring_index x {size} + "
            f"ulysses_index)"
        )


def grid_groups(ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (ring group, Ulysses group) of the default group's ranks laid out as
    ``arange(world).view(R, ulysses)``: rows are Ulysses groups, columns rings. One
    ``DeviceMesh`` (dimensions ``ring`` and ``ulysses``) makes them, each with the default
    group's timeout (:mod:`ringray.attention.groups`). Collective: every rank of the default
    group calls it, once."""
    world = dist.get_world_size()
    if ulysses < 1 or world % ulysses:
        raise ValueError(f"ulysses: {ulysses} does not divide the world of {world} ranks")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dims = (RING_DIM, "ulysses")
    # The ring's point-to-point traffic gets NCCL's high-priority stream (groups.py).
    mesh = init_device_mesh(device_type, (world // ulysses, ulysses), mesh_dim_names=dims,
                            backend_override=with_timeout(dims, group_timeout(),
                                                          high_priority=(RING_DIM,)))
    return mesh.get_group(RING_DIM), mesh.get_group("ulysses")


# ----------------------------------------------------------------- packing (pure, no comm)
def pack_for_heads(tensors: Sequence[torch.Tensor], ulysses: int) -> torch.Tensor:
    """``(batch, local, heads_i, dim)`` tensors -> one ``(U, batch, local, sum heads_i / U,
    dim)`` send buffer whose block j holds head group j of every tensor (for rank j)."""
    batch, local, _, dim = tensors[0].shape
    widths = [t.shape[2] // ulysses for t in tensors]
    buffer = tensors[0].new_empty(ulysses, batch, local, sum(widths), dim)
    offset = 0
    for t, width in zip(tensors, widths, strict=True):
        part = t.reshape(batch, local, ulysses, width, dim).permute(2, 0, 1, 3, 4)
        buffer[:, :, :, offset:offset + width].copy_(part)
        offset += width
    return buffer


def unpack_heads(received: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse view of :func:`pack_for_heads` after the all-to-all: block i came from rank
    i's sub-shard, so the result is ``(batch, U * local, width_i, dim)`` per tensor, the
    sub-shards in order (the ring member's chunk), contiguous."""
    ulysses, batch, local, _, dim = received.shape
    out, offset = [], 0
    for width in widths:
        part = received[:, :, :, offset:offset + width].permute(1, 0, 2, 3, 4)
        # contiguous(): with one row, reshape can return a view into ``received``, and a
        # saved q would then keep the received k and v alive through the backward.
        out.append(part.reshape(batch, ulysses * local, width, dim).contiguous())
        offset += width
    return out


def pack_for_sequence(tensors: Sequence[torch.Tensor], ulysses: int) -> torch.Tensor:
    """``(batch, U * local, heads_i, dim)`` tensors -> one ``(U, batch, local, sum heads_i,
    dim)`` send buffer whose block j holds sub-shard j of the sequence (for rank j)."""
    batch, seq, _, dim = tensors[0].shape
    local = seq // ulysses
    widths = [t.shape[2] for t in tensors]
    buffer = tensors[0].new_empty(ulysses, batch, local, sum(widths), dim)
    offset = 0
    for t, width in zip(tensors, widths, strict=True):
        part = t.reshape(batch, ulysses, local, width, dim).permute(1, 0, 2, 3, 4)
        buffer[:, :, :, offset:offset + width].copy_(part)
        offset += width
    return buffer


def unpack_sequence(received: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """Inverse view of :func:`pack_for_sequence` after the all-to-all: block i holds head
    group i, so the result is ``(batch, local, U * width_i, dim)`` per tensor, contiguous."""
    ulysses, batch, local, _, dim = received.shape
    out, offset = [], 0
    for width in widths:
        part = received[:, :, :, offset:offset + width].permute(1, 2, 0, 3, 4)
        out.append(part.reshape(batch, local, ulysses * width, dim).contiguous())
        offset += width
    return out


# ----------------------------------------------------------------- the all-to-alls
def _to_heads(tensors: Sequence[torch.Tensor], comm: UlyssesComm, stats: RingStats | None,
              phase: str, name: str) -> list[torch.Tensor]:
    """One all-to-all, sequence sub-shards to head groups, timed with its copies."""
    timer = _start(stats, tensors[0].device)
    widths = [t.shape[2] // comm.world_size for t in tensors]
    buffer = pack_for_heads(tensors, comm.world_size)
    out = unpack_heads(comm.exchange(buffer), widths)
    _record(stats, timer, phase, name, comm.bytes_sent(buffer))
    return out


def _to_sequence(tensors: Sequence[torch.Tensor], comm: UlyssesComm, stats: RingStats | None,
                 phase: str, name: str) -> list[torch.Tensor]:
    """One all-to-all, head groups to sequence sub-shards, timed with its copies."""
    timer = _start(stats, tensors[0].device)
    widths = [t.shape[2] for t in tensors]
    buffer = pack_for_sequence(tensors, comm.world_size)
    out = unpack_sequence(comm.exchange(buffer), widths)
    _record(stats, timer, phase, name, comm.bytes_sent(buffer))
    return out


def _start(stats: RingStats | None, device: torch.device) -> IntervalTimer | None:
    if stats is None:
        return None
    timer = stats.a2a_timer(device)
    timer.start()
    return timer


def _record(stats: RingStats | None, timer: IntervalTimer | None, phase: str, name: str,
            bytes_sent: int) -> None:
    if stats is not None and timer is not None:
        timer.stop()
        stats.add_a2a(phase, name, timer, bytes_sent)


class _SequenceToHeads(torch.autograd.Function):
    """q, k, v for this rank's positions and all heads -> the member's chunk, H/U heads."""

    @staticmethod
    def forward(ctx, comm: UlyssesComm, stats: RingStats | None, *tensors):
        ctx.comm, ctx.stats = comm, stats
        return tuple(_to_heads(tensors, comm, stats, "forward", "qkv"))

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *_to_sequence(grads, ctx.comm, ctx.stats, "backward", "dqkv")


class _HeadsToSequence(torch.autograd.Function):
    """The ring's output for the chunk and H/U heads -> this rank's positions, all heads."""

    @staticmethod
    def forward(ctx, comm: UlyssesComm, stats: RingStats | None, out: torch.Tensor):
        ctx.comm, ctx.stats = comm, stats
        return _to_sequence([out], comm, stats, "forward", "out")[0]

    @staticmethod
    def backward(ctx, dout):
        return None, None, _to_heads([dout], ctx.comm, ctx.stats, "backward", "dout")[0]


def sequence_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: UlyssesComm,
    stats: RingStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's first all-to-all (one, q/k/v packed): ``(batch, local, heads, dim)``
    -> ``(batch, U * local, heads / U, dim)``, K/V repeated first when U > kv_heads."""
    repeat = check_ulysses_heads(q.shape[2], k.shape[2], comm.world_size)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    q_heads, k_heads, v_heads = _SequenceToHeads.apply(comm, stats, q, k, v)
    return q_heads, k_heads, v_heads


def heads_to_sequence(out: torch.Tensor, comm: UlyssesComm,
                      stats: RingStats | None = None) -> torch.Tensor:
    """The forward's last all-to-all: ``(batch, U * local, heads / U, dim)`` -> ``(batch,
    local, heads, dim)``; its backward sends dout the other way."""
    return _HeadsToSequence.apply(comm, stats, out)


def lse_to_sequence(lse: torch.Tensor, comm: UlyssesComm,
                    stats: RingStats | None = None) -> torch.Tensor:
    """The ring's LSE ``(batch, heads / U, U * local)`` in the caller's form ``(batch,
    heads, local)`` (not differentiable)."""
    as_heads = lse.detach().transpose(1, 2).unsqueeze(-1)
    back = _to_sequence([as_heads], comm, stats, "forward", "lse")[0]
    return back.squeeze(-1).transpose(1, 2).contiguous()


@torch.no_grad()
def ulysses_transfer_seconds(comm: UlyssesComm, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor) -> float:
    """Wall seconds of one call's four all-to-alls (q/k/v in, output back; dout in, dq/dk/dv
    back) with their packing copies and no compute in between, for this rank's inputs.
    Collective over ``comm``'s group; the baseline that shows how much of a measured
    all-to-all was the transfer and how much waiting for the group's slowest rank."""
    if comm.world_size == 1:
        return 0.0
    dist.barrier(group=comm.group)
    start = time.perf_counter()
    q_heads, k_heads, v_heads = sequence_to_heads(q, k, v, comm)
    out = _to_sequence([q_heads], comm, None, "forward", "out")[0]  # the output: q's shape
    _to_heads([out], comm, None, "backward", "dout")
    _to_sequence([q_heads, k_heads, v_heads], comm, None, "backward", "dqkv")
    if q.device.type == "cuda":
        torch.cuda.synchronize(q.device)
    return time.perf_counter() - start
