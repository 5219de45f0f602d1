"""Sequence layouts: which global tokens each rank of a ring holds, and in what order.

A layout is data. It maps every global token index to a (rank, local index) pair, and that
is all the ring needs: the causal rule is applied to global positions (``q_pos >= k_pos``),
so any layout is exact by construction and layouts differ only in how evenly they spread the
causal work.

    >>> lay = make_layout("zigzag", world_size=4, seq_len=16)
    >>> lay.positions(0).tolist()
    [0, 1, 14, 15]
    >>> x_local = lay.shard(x_global, rank=0)          # (batch, 4, ...) from (batch, 16, ...)
    >>> x_global = lay.unshard([lay.shard(x_global, r) for r in range(4)])

Built in: ``contiguous`` (rank r holds one slice), ``zigzag`` (2N chunks, rank r holds
chunks r and 2N-1-r, as in ring-flash-attn, Megatron and TransformerEngine), ``striped``
(token t on rank t mod N, as in the Striped Attention paper), ``balanced`` (for packed
documents: equal tokens and near-equal work under the document mask for any document
lengths, see :mod:`.balance`), ``whole`` (the same work equality, keeping documents on as
few ranks as it can, so that fewer keys travel: :mod:`.balance`), and any
explicit permutation given as one position list per rank. Every layout is exact with
documents; ``balanced`` and ``whole`` are the ones that also balance them:

    >>> lay = make_layout("balanced", 4, 16384, documents=[5218, 227, 97, ...])
    >>> document_work(lay, [5218, 227, 97, ...])   # visible query-key pairs per rank

Two-dimensional context parallelism (Ulysses inside a node, the ring across nodes):
``make_layout(kind, world_size, seq_len, ulysses=U)`` lays the sequence over R = world / U
ring members with ``kind`` and cuts each member's chunk, in its local order, into U
consecutive sub-shards: global rank ``ring_index * U + ulysses_index`` holds sub-shard
``ulysses_index`` of ring member ``ring_index``. After the Ulysses all-to-all each rank of a
Ulysses group holds its member's whole chunk (for H/U heads), so the ring over R keeps the
chosen layout's balance (:mod:`.ulysses`). ``layout.ring`` is that R-rank layout.

    >>> lay = make_layout("zigzag", 4, 16, ulysses=2)   # ring of 2, Ulysses groups of 2
    >>> [lay.positions(r).tolist() for r in range(4)]
    [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from ringray.attention.balance import balanced_ranges, whole_ranges
from ringray.attention.documents import Documents, check_documents
from ringray.attention.numbering import best_numbering

# The layouts a job spec may name (each works for any document lengths).
BUILTIN_LAYOUTS = ("contiguous", "zigzag", "striped")
# Layouts built for the documents of one sequence (they need their lengths; without them
# they balance one causal span): ``balanced`` spreads heavy documents over every rank,
# ``whole`` keeps every document on as few ranks as it can.
DOCUMENT_LAYOUTS = ("balanced", "whole")
# Every named layout.
LAYOUT_KINDS = (*BUILTIN_LAYOUTS, *DOCUMENT_LAYOUTS)


@dataclass(frozen=True)
class Run:
    """An arithmetic run of global positions stored at consecutive local indices.

    Local indices ``local_start .. local_start + length - 1`` hold global positions
    ``global_start + i * stride``. Runs let the step planner reason about whole blocks
    instead of single tokens.
    """

    local_start: int
    global_start: int
    stride: int
    length: int

    @property
    def global_last(self) -> int:
        return self.global_start + (self.length - 1) * self.stride


# A custom layout whose ranks break into more runs than this is planned as one irregular
# block per rank (one position-masked kernel call per ring step) instead of run by run.
MAX_RUNS_PER_RANK = 8


class Layout:
    """How a sequence of ``seq_len`` tokens is spread over ``world_size`` ranks.

    Immutable once built; construct with :func:`make_layout`. ``positions(rank)[i]`` is the
    global index of the token at local index ``i`` on ``rank``.

    A two-dimensional layout (``ulysses > 1``) covers all ``world_size = R * U`` ranks of a
    ring × Ulysses grid; ``ring`` is the R-rank layout its ring runs over (for a plain
    layout, the layout itself).
    """

    def __init__(
        self,
        kind: str,
        world_size: int,
        seq_len: int,
        rank_positions: torch.Tensor,
        rank_runs: tuple[tuple[Run, ...], ...] | None = None,
        *,
        ring: Layout | None = None,
    ):
        self.kind = kind
        self.world_size = world_size
        self.seq_len = seq_len
        self._positions = rank_positions  # (world_size, local_len) int64, read-only by contract
        # Built-in layouts state their runs; a custom permutation's are found greedily.
        self._given_runs = rank_runs
        self.ring: Layout = ring if ring is not None else self
        self.ulysses = world_size // self.ring.world_size  # ranks per Ulysses group

    def __repr__(self) -> str:
        grid = f", ulysses={self.ulysses}" if self.ulysses > 1 else ""
        return (f"Layout({self.kind!r}, world_size={self.world_size}, seq_len={self.seq_len}"
                f"{grid})")

    @property
    def local_len(self) -> int:
        """Tokens per rank."""
        return self.seq_len // self.world_size

    @property
    def divisor(self) -> int:
        """What a sequence length must be a multiple of for this kind of layout over this
        many ranks (a custom permutation fits exactly its own length)."""
        if self.kind in LAYOUT_KINDS:
            return seq_len_divisor(self.kind, self.world_size, ulysses=self.ulysses)
        return self.seq_len

    def positions(self, rank: int) -> torch.Tensor:
        """Global token indices held by ``rank``, in local order (int64, CPU)."""
        return self._positions[rank]

    def runs(self, rank: int) -> tuple[Run, ...]:
        """``rank``'s positions as maximal arithmetic runs of positive stride."""
        return self._runs[rank]

    def is_regular(self, rank: int) -> bool:
        """True when the planner can split this rank's blocks into fused-kernel pieces."""
        return len(self._runs[rank]) <= MAX_RUNS_PER_RANK

    @cached_property
    def _runs(self) -> tuple[tuple[Run, ...], ...]:
        if self._given_runs is not None:
            return self._given_runs
        return tuple(_split_runs(self._positions[r].tolist()) for r in range(self.world_size))

    @cached_property
    def fingerprint(self) -> int:
        """A 31-bit checksum of the layout, used to check that all ranks agree on it."""
        grid = f":u{self.ulysses}" if self.ulysses > 1 else ""
        digest = zlib.crc32(f"{self.kind}:{self.world_size}:{self.seq_len}{grid}".encode())
        digest = zlib.crc32(self._positions.numpy().tobytes(), digest)
        return digest & 0x7FFFFFFF

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The part of global tensor ``x`` that ``rank`` holds, in local order."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"shard: x.shape[{dim}] is {x.shape[dim]} but the layout covers "
                f"seq_len={self.seq_len}"
            )
        return x.index_select(dim, self._positions[rank].to(x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Reassemble the global tensor from every rank's shard (inverse of :meth:`shard`)."""
        if len(shards) != self.world_size:
            raise ValueError(
                f"unshard: got {len(shards)} shards for a layout of world_size={self.world_size}"
            )
        first = shards[0]
        shape = list(first.shape)
        shape[dim] = self.seq_len
        out = first.new_empty(shape)
        for rank, part in enumerate(shards):
            if part.shape[dim] != self.local_len:
                raise ValueError(
                    f"unshard: shard {rank} has {part.shape[dim]} tokens along dim {dim}, "
                    f"expected local_len={self.local_len}"
                )
            out.index_copy_(dim, self._positions[rank].to(part.device), part)
        return out


def seq_len_divisor(kind: str, world_size: int, ulysses: int = 1) -> int:
    """What the global sequence length of a built-in layout must be a multiple of.

    ``world_size`` counts every rank; with ``ulysses=U`` the ring has ``world_size / U``
    members, each of whose chunks must also split into U equal sub-shards.
    """
    ring_size = _ring_size(world_size, ulysses)
    if kind == "zigzag":
        ring_divisor = 2 * ring_size
    elif kind in ("contiguous", "striped", *DOCUMENT_LAYOUTS):
        ring_divisor = ring_size
    else:
        raise ValueError(f"layout: unknown kind {kind!r}; valid: {', '.join(LAYOUT_KINDS)}")
    return math.lcm(ring_divisor, world_size)


def _ring_size(world_size: int, ulysses: int) -> int:
    """Ring members R of a ``world_size``-rank grid with Ulysses groups of ``ulysses``."""
    if ulysses < 1 or world_size % ulysses:
        raise ValueError(
            f"ulysses: {ulysses} ranks per Ulysses group do not divide the {world_size} ranks; "
            f"use a divisor of {world_size}"
        )
    return world_size // ulysses


def make_layout(
    kind_or_positions: str | Layout | Sequence[Sequence[int]],
    world_size: int,
    seq_len: int,
    *,
    documents: Documents | Sequence[int] | None = None,
    ulysses: int = 1,
) -> Layout:
    """Build (or check) the layout of ``seq_len`` tokens over ``world_size`` ranks.

    ``kind_or_positions`` is a built-in name, an existing :class:`Layout` (checked against
    ``world_size`` and ``seq_len``), or one list of global positions per rank, which must
    together be a permutation of ``range(seq_len)`` with equal lengths.

    ``documents`` (the global sequence's document lengths, summing to ``seq_len``) shapes the
    ``balanced`` and ``whole`` layouts only; every other layout is the same with or without them.

    ``ulysses=U > 1``: a two-dimensional layout over ``world_size = R * U`` ranks (see the
    module docstring). ``kind_or_positions`` then describes the ring over R: a name, an
    R-rank :class:`Layout` or R position lists; or it is a two-dimensional layout, checked.
    """
    if world_size < 1:
        raise ValueError(f"layout: world_size must be >= 1, got {world_size}")
    ring_size = _ring_size(world_size, ulysses)
    if ulysses > 1:
        if isinstance(kind_or_positions, Layout) and (kind_or_positions.ulysses > 1 or
                                                      kind_or_positions.world_size != ring_size):
            return _checked(kind_or_positions, world_size, seq_len, ulysses)
        divisor = _grid_divisor(kind_or_positions, world_size, ulysses)
        if seq_len <= 0 or seq_len % divisor:
            name = kind_or_positions if isinstance(kind_or_positions, str) else "custom"
            raise ValueError(
                f"layout: seq_len={seq_len} cannot be split by layout {name!r} over "
                f"{ring_size} ring ranks x ulysses={ulysses}; it must be a positive multiple "
                f"of {divisor}"
            )
        ring = make_layout(kind_or_positions, ring_size, seq_len, documents=documents)
        return _grid(ring, ulysses)
    if isinstance(kind_or_positions, Layout):
        return _checked(kind_or_positions, world_size, seq_len, ulysses)
    if isinstance(kind_or_positions, str):
        if kind_or_positions in DOCUMENT_LAYOUTS:
            _check_divisible(kind_or_positions, world_size, seq_len)
            docs = check_documents(documents, seq_len) or Documents((seq_len,))
            return _balanced(world_size, seq_len, docs, kind_or_positions)
        return _builtin(kind_or_positions, world_size, seq_len)
    return _custom(kind_or_positions, world_size, seq_len)


def _checked(lay: Layout, world_size: int, seq_len: int, ulysses: int) -> Layout:
    """``lay`` if it was built for this many ranks, tokens and ranks per Ulysses group."""
    if lay.world_size != world_size or lay.seq_len != seq_len or lay.ulysses != ulysses:
        grid, needs = ((f", ulysses={lay.ulysses}", f", ulysses={ulysses}")
                       if max(lay.ulysses, ulysses) > 1 else ("", ""))
        raise ValueError(
            f"layout: got a layout for world_size={lay.world_size}, seq_len={lay.seq_len}{grid} "
            f"but the call needs world_size={world_size}, seq_len={seq_len}{needs}"
        )
    return lay


def _grid_divisor(kind_or_positions: object, world_size: int, ulysses: int) -> int:
    if isinstance(kind_or_positions, str) and kind_or_positions in LAYOUT_KINDS:
        return seq_len_divisor(kind_or_positions, world_size, ulysses)
    return world_size


# Memoised on the ring layout (itself memoised), so that repeated calls share one grid.
@lru_cache(maxsize=16)
def _grid(ring: Layout, ulysses: int) -> Layout:
    """Ring member r's chunk, in its local order, cut into ``ulysses`` consecutive sub-shards:
    grid rank ``r * ulysses + u`` holds sub-shard u."""
    pos = ring._positions.reshape(ring.world_size * ulysses, ring.local_len // ulysses)
    return Layout(ring.kind, ring.world_size * ulysses, ring.seq_len, pos, ring=ring)


def _check_divisible(kind: str, world_size: int, seq_len: int) -> None:
    divisor = seq_len_divisor(kind, world_size)
    if seq_len <= 0 or seq_len % divisor:
        raise ValueError(
            f"layout: seq_len={seq_len} cannot be split by layout {kind!r} over "
            f"{world_size} ranks; it must be a positive multiple of {divisor}"
        )


@lru_cache(maxsize=16)  # documents change every batch; the last few are reused by the ring
def _balanced(world_size: int, seq_len: int, documents: Documents, kind: str) -> Layout:
    if kind == "balanced":
        return _from_ranges(kind, seq_len, balanced_ranges(world_size, seq_len, documents))
    layout = _from_ranges(kind, seq_len, whole_ranges(world_size, seq_len, documents))
    return _numbered(layout, documents)


def _from_ranges(kind: str, seq_len: int, ranges: list[list[tuple[int, int]]]) -> Layout:
    pos = torch.tensor([[p for start, end in rank for p in range(start, end)]
                        for rank in ranges], dtype=torch.int64)
    runs = []
    for rank in ranges:
        local, rank_runs = 0, []
        for start, end in rank:
            rank_runs.append(Run(local, start, 1, end - start))
            local += end - start
        runs.append(tuple(rank_runs))
    return Layout(kind, len(ranges), seq_len, pos, tuple(runs))


def _numbered(layout: Layout, documents: Documents) -> Layout:
    """``layout`` with its ranks' shares renumbered so that the ring's rounds wait least
    (the layout optimiser's :func:`~.numbering.best_numbering` over its block-work
    matrix)."""
    best = best_numbering(block_work(layout, documents))
    if best == list(range(layout.world_size)):
        return layout
    runs = layout._given_runs
    return Layout(layout.kind, layout.world_size, layout.seq_len, layout._positions[best],
                  None if runs is None else tuple(runs[r] for r in best))


# Memoised so that repeated calls with a layout name share one Layout, and with it the
# ring's cached step plans; layouts are immutable, so sharing is safe.
@lru_cache(maxsize=16)
def _builtin(kind: str, world_size: int, seq_len: int) -> Layout:
    _check_divisible(kind, world_size, seq_len)
    n, local = world_size, seq_len // world_size
    if kind == "contiguous":
        pos = torch.arange(seq_len).view(n, local)
        runs = tuple((Run(0, r * local, 1, local),) for r in range(n))
    elif kind == "striped":
        pos = torch.arange(seq_len).view(local, n).t().contiguous()
        runs = tuple((Run(0, r, n, local),) for r in range(n))
    else:  # zigzag: chunk r and chunk 2N-1-r
        half = local // 2
        chunks = torch.arange(seq_len).view(2 * n, half)
        pos = torch.cat([chunks[:n], chunks[n:].flip(0)], dim=1)
        runs = tuple(
            (Run(0, r * half, 1, half), Run(half, (2 * n - 1 - r) * half, 1, half))
            for r in range(n)
        )
    return Layout(kind, world_size, seq_len, pos, runs)


def _custom(rank_positions: Sequence[Sequence[int]], world_size: int, seq_len: int) -> Layout:
    if len(rank_positions) != world_size:
        raise ValueError(
            f"layout: got position lists for {len(rank_positions)} ranks, "
            f"expected world_size={world_size}"
        )
    lengths = {len(p) for p in rank_positions}
    if len(lengths) != 1:
        raise ValueError(f"layout: every rank must hold the same number of tokens, got {lengths}")
    pos = torch.tensor([list(p) for p in rank_positions], dtype=torch.int64)
    if pos.numel() != seq_len or not torch.equal(pos.flatten().sort().values,
                                                   torch.arange(seq_len)):
        raise ValueError(
            f"layout: the per-rank position lists must together be a permutation of "
            f"range({seq_len}) (each token on exactly one rank)"
        )
    return Layout("custom", world_size, seq_len, pos)


def _split_runs(positions: list[int]) -> tuple[Run, ...]:
    """Greedy split into maximal arithmetic runs of positive stride."""
    runs: list[Run] = []
    i = 0
    while i < len(positions):
        start = positions[i]
        if i + 1 < len(positions) and positions[i + 1] > start:
            stride = positions[i + 1] - start
            j = i + 1
            while j + 1 < len(positions) and positions[j + 1] - positions[j] == stride:
                j += 1
        else:
            stride, j = 1, i
        runs.append(Run(local_start=i, global_start=start, stride=stride, length=j - i + 1))
        i = j + 1
    return tuple(runs)


def causal_work(layout: Layout) -> list[int]:
    """Query-key pairs each rank computes under the causal mask (its queries' visible keys).

    The token at global position p attends to p + 1 keys, so a rank's work is the sum of
    (p + 1) over its positions. ``max / mean`` of this list is the layout's theoretical
    load imbalance. (For a ring × Ulysses layout pass ``layout.ring``: after the all-to-all a
    Ulysses group's ranks share their ring member's work equally, by heads.)
    """
    return [int((layout.positions(r) + 1).sum()) for r in range(layout.world_size)]


def document_work(
    layout: Layout, documents: Documents | Sequence[int] | None, *, causal: bool = True
) -> list[int]:
    """Query-key pairs each rank computes under the document mask: the documents-aware
    counterpart of :func:`causal_work` (equal to it when ``documents`` is ``None`` and
    ``causal``). ``max / mean`` is the layout's theoretical load imbalance for them."""
    docs = check_documents(documents, layout.seq_len) or Documents((layout.seq_len,))
    work = docs.token_work(causal)
    return [int(work[layout.positions(r)].sum()) for r in range(layout.world_size)]


def block_work(
    layout: Layout, documents: Documents | Sequence[int] | None = None, *, causal: bool = True,
    window: int | None = None,
) -> list[list[int]]:
    """Visible query-key pairs per block pair: ``[r][s]`` is what rank ``r`` computes at the
    ring step that holds rank ``s``'s keys (row sums: :func:`document_work` without a
    window). With ``window`` (causal), a query sees only keys at most ``window - 1``
    positions before it. A zero is a block pair nobody computes, and a K/V block nobody
    needs to send (:mod:`.transfers`).

    A ring step waits for its slowest rank, so ``sum over steps t of max over ranks r of
    [r][(r - t) mod N]``, against the mean row sum, is the layout's theoretical imbalance
    *per step* (:func:`step_imbalance`); a layout can be balanced in total and not per step.
    """
    if window is not None and not causal:
        raise ValueError(f"window: {window} needs causal=True (a window bounds how far back "
                         f"a query looks)")
    docs = check_documents(documents, layout.seq_len) or Documents((layout.seq_len,))
    first = torch.tensor(docs.bounds[:-1])[docs.ids]  # each position's document start
    last = torch.tensor(docs.bounds[1:])[docs.ids] - 1
    # below[s, p]: how many of rank s's positions are below p, so rank s holds
    # below[s, hi + 1] - below[s, lo] of the keys lo..hi.
    owner = torch.empty(layout.seq_len, dtype=torch.int64)
    for s in range(layout.world_size):
        owner[layout.positions(s)] = s
    held = torch.nn.functional.one_hot(owner, layout.world_size).t()
    below = torch.nn.functional.pad(held.cumsum(1), (1, 0))
    matrix = []
    for r in range(layout.world_size):
        q_pos = layout.positions(r)
        lo, hi = first[q_pos], q_pos if causal else last[q_pos]  # visible keys: lo..hi
        if window is not None:
            lo = torch.maximum(lo, q_pos - (window - 1))
        matrix.append((below[:, hi + 1] - below[:, lo]).sum(1).tolist())
    return matrix


def step_imbalance(work: list[list[int]]) -> float:
    """``sum_t max_r work[r][(r - t) mod N]`` over the mean row sum, for a
    :func:`block_work` matrix: 1.0 when every ring step is balanced."""
    world = len(work)
    mean = sum(map(sum, work)) / world
    steps = sum(max(work[r][(r - t) % world] for r in range(world)) for t in range(world))
    return steps / mean if mean > 0 else 1.0
