"""Work planning for one ring step: which kernel calls turn a block pair into exact attention.

At a ring step, a rank attends its local queries (global positions known from the layout) to
one K/V block (positions known too). Under the causal rule ``q_pos >= k_pos`` the pair splits
into rectangles of four kinds:

- ``FULL``: every query sees every key: an unmasked kernel call.
- ``CAUSAL``: a square whose query i sees keys 0..i (top-left aligned): the fused kernel's
  own causal mode.
- ``MASKED``: anything else: a kernel call with an explicit position mask (only irregular
  custom layouts produce these).
- empty: no query sees any key: no call at all.

For two runs of equal stride d (contiguous, zigzag halves, striped blocks), query i sees key
j exactly when ``j <= i + c`` with ``c = floor((q_start - k_start) / d)``, so the pair is a
band of empty rows, a band of triangle rows (a full rectangle on the left plus a CAUSAL
square) and a band of full rows. zigzag and striped therefore never need a mask: striped's
"shifted diagonal" (a query stripe ahead of the key stripe) is a CAUSAL square one row down
and one key short, its first query row empty.

Everything here is pure: plain data in, frozen dataclasses out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ringray.attention.layouts import Layout, Run


class PieceKind(enum.Enum):
    FULL = "full"
    CAUSAL = "causal"
    MASKED = "masked"


@dataclass(frozen=True)
class Piece:
    """One kernel call: local query rows ``[q_start, q_end)`` against block keys
    ``[k_start, k_end)``."""

    kind: PieceKind
    q_start: int
    q_end: int
    k_start: int
    k_end: int

    @property
    def pairs(self) -> int:
        """Query-key pairs this piece computes (the useful work)."""
        rows, cols = self.q_end - self.q_start, self.k_end - self.k_start
        if self.kind is PieceKind.CAUSAL:
            return rows * (rows + 1) // 2
        return rows * cols


def plan_block(
    q_runs: tuple[Run, ...] | None,
    k_runs: tuple[Run, ...] | None,
    q_len: int,
    k_len: int,
    q_bounds: tuple[int, int],
    k_bounds: tuple[int, int],
    causal: bool,
) -> tuple[Piece, ...]:
    """Pieces for a query block against a key block.

    ``q_runs``/``k_runs`` describe regular blocks; ``None`` marks an irregular block, which
    is planned as one ``MASKED`` piece unless its position range makes it full or empty.
    ``q_bounds``/``k_bounds`` are the blocks' (min, max) global positions.
    """
    if not causal or q_bounds[0] >= k_bounds[1]:
        return (Piece(PieceKind.FULL, 0, q_len, 0, k_len),)
    if q_bounds[1] < k_bounds[0]:
        return ()
    if q_runs is None or k_runs is None:
        return (Piece(PieceKind.MASKED, 0, q_len, 0, k_len),)
    pieces: list[Piece] = []
    for qr in q_runs:
        for kr in k_runs:
            pieces.extend(_plan_runs(qr, kr))
    return coalesce(pieces)


def _plan_runs(q: Run, k: Run) -> list[Piece]:
    """Pieces for one query run against one key run (causal)."""
    q0, k0 = q.local_start, k.local_start
    if q.global_start >= k.global_last:
        return [Piece(PieceKind.FULL, q0, q0 + q.length, k0, k0 + k.length)]
    if q.global_last < k.global_start:
        return []
    if k.length == 1:  # the queries that see this one key form a suffix of the run
        first = -(-(k.global_start - q.global_start) // q.stride)
        return [Piece(PieceKind.FULL, q0 + first, q0 + q.length, k0, k0 + 1)]
    if q.length == 1:  # this one query sees a prefix of the key run
        seen = (q.global_start - k.global_start) // k.stride + 1
        return [Piece(PieceKind.FULL, q0, q0 + 1, k0, k0 + seen)]
    if q.stride != k.stride:
        return [Piece(PieceKind.MASKED, q0, q0 + q.length, k0, k0 + k.length)]

    m, n = q.length, k.length
    c = (q.global_start - k.global_start) // q.stride  # query i sees keys j <= i + c
    tri_start = max(0, -c)  # rows before it see no key
    tri_end = min(max(n - c, tri_start), m)  # rows from it on see every key
    left = max(c, 0)  # keys every triangle row sees
    pieces: list[Piece] = []
    if tri_end > tri_start:
        if left > 0:
            pieces.append(Piece(PieceKind.FULL, q0 + tri_start, q0 + tri_end, k0, k0 + left))
        side = tri_end - tri_start
        pieces.append(
            Piece(PieceKind.CAUSAL, q0 + tri_start, q0 + tri_end, k0 + left, k0 + left + side)
        )
    if tri_end < m:
        pieces.append(Piece(PieceKind.FULL, q0 + tri_end, q0 + m, k0, k0 + n))
    return pieces


def coalesce(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Merge FULL (or MASKED) pieces that share a key range and touch in query rows, or
    share query rows and touch in keys, so each kernel call is as large as possible."""
    merged = list(pieces)
    changed = True
    while changed:
        changed = False
        for i in range(len(merged)):
            for j in range(len(merged)):
                if i != j and (joined := _join(merged[i], merged[j])) is not None:
                    merged[i] = joined
                    del merged[j]
                    changed = True
                    break
            if changed:
                break
    return tuple(sorted(merged, key=lambda p: (p.q_start, p.k_start)))


def _join(a: Piece, b: Piece) -> Piece | None:
    if a.kind is not b.kind or a.kind is PieceKind.CAUSAL:
        return None
    if (a.k_start, a.k_end) == (b.k_start, b.k_end) and a.q_end == b.q_start:
        return Piece(a.kind, a.q_start, b.q_end, a.k_start, a.k_end)
    if (a.q_start, a.q_end) == (b.q_start, b.q_end) and a.k_end == b.k_start:
        return Piece(a.kind, a.q_start, a.q_end, a.k_start, b.k_end)
    return None


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank computes in one ring call: ``pieces[src]`` for the K/V block
    that started on rank ``src``."""

    rank: int
    pieces: tuple[tuple[Piece, ...], ...]

    @property
    def pairs_per_block(self) -> tuple[int, ...]:
        return tuple(sum(p.pairs for p in block) for block in self.pieces)


def plan_rank(layout: Layout, rank: int, causal: bool) -> RankPlan:
    """Plan every block pair (``rank``'s queries × each rank's keys) for one ring call."""
    q_pos = layout.positions(rank)
    q_runs = layout.runs(rank) if layout.is_regular(rank) else None
    q_bounds = (int(q_pos.min()), int(q_pos.max()))
    blocks = []
    for src in range(layout.world_size):
        k_pos = layout.positions(src)
        k_runs = layout.runs(src) if layout.is_regular(src) else None
        blocks.append(
            plan_block(
                q_runs, k_runs, len(q_pos), len(k_pos),
                q_bounds, (int(k_pos.min()), int(k_pos.max())), causal,
            )
        )
    return RankPlan(rank=rank, pieces=tuple(blocks))
