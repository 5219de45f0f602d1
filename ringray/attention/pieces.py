"""Work planning for one ring step: which kernel calls turn a block pair into exact attention.

At a ring step, a rank attends its local queries (global positions known from the layout) to
one K/V block (positions known too). Under the causal rule ``q_pos >= k_pos`` the pair splits
into rectangles of four kinds:

- ``FULL``: every query sees every key: an unmasked kernel call.
- ``CAUSAL``: a square whose query i sees keys 0..i (top-left aligned): the fused kernel's
  own causal mode.
- ``MASKED``: anything else: a kernel call with an explicit position mask (irregular
  custom layouts, document boundaries planned by tiles and a sliding window's edge).
- empty: no query sees any key: no call at all.

For two runs of equal stride d (contiguous, zigzag halves, striped blocks), query i sees key
j exactly when ``j <= i + c`` with ``c = floor((q_start - k_start) / d)``, so the pair is a
band of empty rows, a band of triangle rows (a full rectangle on the left plus a CAUSAL
square) and a band of full rows. zigzag and striped therefore never need a mask: striped's
"shifted diagonal" (a query stripe ahead of the key stripe) is a CAUSAL square one row down
and one key short, its first query row empty.

With packed documents (:mod:`.documents`) a query sees a key only inside its own document.
Each run is cut where a document ends into *segments*; only segments of the same document
meet, and each such pair is planned like two runs, so cross-document work is never a kernel
call and a pair inside one document needs no mask. Where segments would be too many (many
tiny documents, or an irregular layout), the block is planned by tiles instead
(:func:`plan_tiles`): tiles wholly across documents or in the future are skipped, tiles
wholly visible are ``FULL``, and only tiles that straddle a document boundary or the causal
diagonal irregularly are ``MASKED``.

A sliding window (``q_pos - k_pos <= window - 1``, causal) cuts the band from below too.
Where a block pair's farthest query-key distance is within the window, the window changes
nothing and the pair is planned as above; otherwise it is planned by tiles under the window
(:func:`plan_tiles`): tiles wholly beyond the window are skipped, tiles wholly inside it are
``FULL``, and only tiles the window's edge (or the diagonal) crosses are ``MASKED``.

Everything here is pure: plain data in, frozen dataclasses out.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringray.attention.documents import Documents
from ringray.attention.layouts import Layout, Run
from ringray.attention.tiles import classify_tile_pair, tile_ranges

# With documents: a block pair is planned segment by segment when its same-document segment
# pairs (about one kernel call each) are at most MIN_SEGMENT_PAIRS, or at most
# MAX_SEGMENT_PAIRS with segments of MIN_SEGMENT_TOKENS on average (shorter ones make calls
# too small to pay for themselves); otherwise by tiles of PLAN_TILE tokens.
MIN_SEGMENT_PAIRS = 8
MAX_SEGMENT_PAIRS = 256
MIN_SEGMENT_TOKENS = 16
PLAN_TILE = 128


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


def plan_rank(
    layout: Layout, rank: int, causal: bool, documents: Documents | None = None,
    window: int | None = None,
) -> RankPlan:
    """Plan every block pair (``rank``'s queries × each rank's keys) for one ring call;
    with ``documents``, under the document mask; with ``window`` (causal), a query sees
    only keys at most ``window - 1`` positions before it."""
    if documents is not None:
        return _plan_rank_documents(layout, rank, causal, documents, window)
    q_pos = layout.positions(rank)
    q_runs = layout.runs(rank) if layout.is_regular(rank) else None
    q_bounds = (int(q_pos.min()), int(q_pos.max()))
    blocks = []
    for src in range(layout.world_size):
        k_pos = layout.positions(src)
        k_bounds = (int(k_pos.min()), int(k_pos.max()))
        if _window_binds(window, q_bounds, k_bounds):
            blocks.append(plan_tiles(q_pos, None, k_pos, None, causal, PLAN_TILE, window))
            continue
        k_runs = layout.runs(src) if layout.is_regular(src) else None
        blocks.append(
            plan_block(q_runs, k_runs, len(q_pos), len(k_pos), q_bounds, k_bounds, causal)
        )
    return RankPlan(rank=rank, pieces=tuple(blocks))


def _window_binds(window: int | None, q_bounds: tuple[int, int],
                  k_bounds: tuple[int, int]) -> bool:
    """Whether some query of the block pair lies more than the window after some key."""
    return window is not None and q_bounds[1] - k_bounds[0] > window - 1


def _plan_rank_documents(
    layout: Layout, rank: int, causal: bool, documents: Documents, window: int | None
) -> RankPlan:
    q_pos = layout.positions(rank)
    q_doc = documents.ids[q_pos]
    q_segs = _segments(layout, rank, documents)
    q_bounds = (int(q_pos.min()), int(q_pos.max()))
    blocks = []
    for src in range(layout.world_size):
        k_pos = layout.positions(src)
        k_doc = documents.ids[k_pos]
        if _window_binds(window, q_bounds, (int(k_pos.min()), int(k_pos.max()))):
            blocks.append(plan_tiles(q_pos, q_doc, k_pos, k_doc, causal, PLAN_TILE, window))
            continue
        blocks.append(plan_document_block(
            q_segs, _segments(layout, src, documents), q_pos, q_doc, k_pos, k_doc, causal,
        ))
    return RankPlan(rank=rank, pieces=tuple(blocks))


def plan_document_block(
    q_segs: dict[int, list[Run]] | None,
    k_segs: dict[int, list[Run]] | None,
    q_pos: torch.Tensor, q_doc: torch.Tensor, k_pos: torch.Tensor, k_doc: torch.Tensor,
    causal: bool,
) -> tuple[Piece, ...]:
    """Pieces for a query block against a key block under the document mask.

    ``q_segs``/``k_segs`` map a document to the block's runs inside it (:func:`_segments`;
    ``None`` when there are too many); ``*_pos``/``*_doc`` are the blocks' global positions
    and document indices, for the tile planner.
    """
    if q_segs is not None and k_segs is not None:
        shared = [d for d in q_segs if d in k_segs]
        pairs = sum(len(q_segs[d]) * len(k_segs[d]) for d in shared)
        long_enough = all(len(pos) >= MIN_SEGMENT_TOKENS * sum(map(len, segs.values()))
                          for pos, segs in ((q_pos, q_segs), (k_pos, k_segs)))
        if pairs <= MIN_SEGMENT_PAIRS or (pairs <= MAX_SEGMENT_PAIRS and long_enough):
            pieces: list[Piece] = []
            for d in shared:
                doc_pieces = []
                for qs in q_segs[d]:
                    for ks in k_segs[d]:
                        if causal:
                            doc_pieces.extend(_plan_runs(qs, ks))
                        else:
                            doc_pieces.append(Piece(PieceKind.FULL, qs.local_start,
                                                    qs.local_start + qs.length, ks.local_start,
                                                    ks.local_start + ks.length))
                pieces.extend(coalesce(doc_pieces))  # pieces of two documents never touch
            return tuple(sorted(pieces, key=lambda p: (p.q_start, p.k_start)))
    return plan_tiles(q_pos, q_doc, k_pos, k_doc, causal, PLAN_TILE)


def _segments(layout: Layout, rank: int, documents: Documents) -> dict[int, list[Run]] | None:
    """``rank``'s runs cut where documents end, by document; ``None`` when there are more
    than :data:`MAX_SEGMENT_PAIRS` (then the planner works by tiles)."""
    runs = layout.runs(rank)
    if len(runs) > MAX_SEGMENT_PAIRS:
        return None
    bounds = documents.bounds
    segments: dict[int, list[Run]] = {}
    count = 0
    for run in runs:
        i = 0
        while i < run.length:
            position = run.global_start + i * run.stride
            doc = bisect.bisect_right(bounds, position) - 1
            # The run's indices whose positions lie before the next document's start.
            inside = min(run.length, -(-(bounds[doc + 1] - run.global_start) // run.stride)) - i
            segments.setdefault(doc, []).append(
                Run(run.local_start + i, position, run.stride, inside)
            )
            i += inside
            count += 1
            if count > MAX_SEGMENT_PAIRS:
                return None
    return segments


def plan_tiles(
    q_pos: torch.Tensor, q_doc: torch.Tensor | None, k_pos: torch.Tensor,
    k_doc: torch.Tensor | None, causal: bool, tile: int = PLAN_TILE,
    window: int | None = None,
) -> tuple[Piece, ...]:
    """Pieces for a block pair cut into ``tile`` × ``tile`` tiles (local indices): runs of
    ``FULL`` or ``MASKED`` tiles along a tile row become one piece, and identical pieces of
    consecutive tile rows join; skipped tiles are no piece at all. ``q_doc``/``k_doc``:
    document indices (``None``: one document); ``window``: a sliding window."""
    runs, straddles = classify_tile_pair(tile_ranges(_int32(q_pos), _int32(q_doc), tile),
                                         tile_ranges(_int32(k_pos), _int32(k_doc), tile),
                                         causal, window)
    kinds = (runs.long() * (2 - straddles.long())).tolist()  # 0 skip, 1 masked, 2 full
    q_len, k_len = len(q_pos), len(k_pos)
    pieces: list[Piece] = []
    last_of: dict[tuple[PieceKind, int, int], int] = {}  # piece that may grow downwards
    for row, row_kinds in enumerate(kinds):
        q0, q1 = row * tile, min((row + 1) * tile, q_len)
        col = 0
        while col < len(row_kinds):
            code = row_kinds[col]
            end = col + 1
            while end < len(row_kinds) and row_kinds[end] == code:
                end += 1
            if code:
                kind = PieceKind.FULL if code == 2 else PieceKind.MASKED
                k0, k1 = col * tile, min(end * tile, k_len)
                above = last_of.get((kind, k0, k1))
                if above is not None and pieces[above].q_end == q0:
                    pieces[above] = Piece(kind, pieces[above].q_start, q1, k0, k1)
                else:
                    last_of[(kind, k0, k1)] = len(pieces)
                    pieces.append(Piece(kind, q0, q1, k0, k1))
            col = end
    return tuple(sorted(pieces, key=lambda p: (p.q_start, p.k_start)))


def _int32(values: torch.Tensor | None) -> torch.Tensor | None:
    return values.to(torch.int32) if values is not None else None


def split_pieces(pieces: tuple[Piece, ...],
                 shares: Sequence[int]) -> tuple[tuple[Piece, ...], ...]:
    """``pieces`` regrouped, in order, into ``len(shares)`` consecutive units whose pairs are
    in the proportions of ``shares`` (as nearly as whole query rows allow), so that a block's
    compute can be spread over several ring steps. A piece is cut only where a unit boundary
    falls inside it, by query rows: a FULL or MASKED piece into row bands over the same keys,
    a CAUSAL square's row band ``[i, j)`` into a FULL rectangle over keys ``[0, i)`` and the
    CAUSAL square ``[i, j)``. So ``k`` units add at most ``2 (k - 1)`` kernel calls to the
    block's own (one share: the pieces as they are). The units cover exactly the pieces'
    query-key pairs; a unit may be empty."""
    total, weight = sum(p.pairs for p in pieces), sum(shares)
    if len(shares) <= 1 or total == 0 or weight <= 0:
        return (tuple(pieces), *((),) * (len(shares) - 1)) if shares else ()
    # The pair counts, from the block's start, at which each unit but the last ends.
    bounds = [total * done / weight for done in itertools.accumulate(shares[:-1])]
    units: list[list[Piece]] = [[] for _ in shares]
    unit, start = 0, 0
    for piece in pieces:
        rows, end = piece.q_end - piece.q_start, start + piece.pairs
        edges, owners = [0], []
        while unit < len(bounds) and bounds[unit] < end:
            edges.append(min(max(_rows_holding(piece, bounds[unit] - start), edges[-1]), rows))
            owners.append(unit)
            unit += 1
        edges.append(rows)
        owners.append(unit)
        for (lo, hi), owner in zip(itertools.pairwise(edges), owners, strict=True):
            units[owner].extend(_row_band(piece, lo, hi))
        start = end
    return tuple(tuple(u) for u in units)


def _rows_holding(piece: Piece, pairs: float) -> int:
    """The number of the piece's first query rows whose pairs come nearest to ``pairs``."""
    if pairs <= 0:
        return 0
    if piece.kind is PieceKind.CAUSAL:  # rows i < j hold j (j + 1) / 2 pairs
        return round(((8 * pairs + 1) ** 0.5 - 1) / 2)
    return round(pairs / (piece.k_end - piece.k_start))


def _row_band(piece: Piece, lo: int, hi: int) -> tuple[Piece, ...]:
    """The piece's query rows ``[lo, hi)`` (relative to its first), as kernel calls."""
    rows = piece.q_end - piece.q_start
    if hi <= lo:
        return ()
    if (lo, hi) == (0, rows):
        return (piece,)
    q0, q1 = piece.q_start + lo, piece.q_start + hi
    if piece.kind is not PieceKind.CAUSAL:
        return (Piece(piece.kind, q0, q1, piece.k_start, piece.k_end),)
    band = (Piece(PieceKind.CAUSAL, q0, q1, piece.k_start + lo, piece.k_start + hi),)
    return (Piece(PieceKind.FULL, q0, q1, piece.k_start, piece.k_start + lo), *band) if lo \
        else band
