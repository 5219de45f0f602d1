"""The ``balanced`` layout's assignment: equal tokens per rank and near-equal attention work,
in total and at every ring step, for any document lengths.

Work is what a query costs under the document mask (causal): the token at offset ``i`` of its
document sees ``i + 1`` keys. Three facts make the assignment simple:

- **A symmetric head/tail cut has work proportional to its size.** Take ``h`` tokens from the
  head of a document of length ``L`` at offset ``a`` and ``h`` from its tail at offset
  ``L - a - h``: their work is ``h (L + 1)`` whatever ``a`` is (zigzag's pairing, inside one
  document). So a document cut into nested head/tail pieces behaves like a fluid of constant
  *density* ``(L + 1) / 2`` work per token, and each piece is at most two runs of positions.
- **Zigzag is balanced at every step.** A document cut into 2N chunks, rank r holding chunks
  r and 2N-1-r, gives every rank the same work against every other rank's keys at each ring
  step, not only in total. Heavy documents (more than 1/SPREAD_SHARE of a rank's mean work)
  are spread over all ranks this way. Light ones stay whole where possible: a document on
  one rank only adds work to that rank's own block (ring step 0).
- **Two pointers over density.** With the light documents sorted by density, a rank that
  takes ``a`` tokens from the dense end and the rest of its share from the sparse end has a
  work that grows with ``a``; some ``a`` tops its total up to the mean of what is left (the
  sparse end is below the mean, the dense end above). Rank ``r`` takes exactly that, so every
  rank but the last lands within about one token's work of its target and the last takes the
  remainder. At most two light documents are cut per rank.

The ``whole`` layout keeps the total work equal and lets as few keys as it can travel. Under
the mask a rank reads, of each document it holds part of, the keys below its highest
position there that other ranks hold: ``top + 1 - own`` rows (:func:`received_rows`). So a
document on one rank costs nothing, and one cut over several costs the sum of the lower
holders' highest positions; which tokens below them a holder takes is free. It is built two
ways, and :func:`whole_ranges` keeps the one that reads fewer rows:

- **Nested** (``balanced_ranges(spread=False)``): no spreading; every document goes through
  the two pointers, so it lives on one rank unless a rank's share runs out inside it, and
  the few it is cut over hold nested head/tail pieces (work still follows tokens). At most
  2 (N - 1) cuts in all, but the cuts land wherever the shares end, on light documents too.
- **Runs** (:func:`run_ranges`): a document with more work than a rank's mean is cut into
  runs of :data:`RUN_UNIT` positions, each an item of its own density, and every other
  document is atomic (taken whole, passed over by a rank it does not fit). The two pointers
  then hand a heavy document's highest runs to the ranks that need dense work, and its
  lowest runs, which cost nothing to a rank holding higher ones, to those that need tokens:
  they balance the work, so the light documents need not be cut. It wins where one document
  holds most of the work (the standard library at 64k, where one file holds 79 %: 29.9 % of
  the plain ring's bytes over 4 ranks and 33.6 % over 8, against 36.1 % and 38.7 % nested).

Either way the work is equal in total, not at every ring step, which matters less once each
block goes only to its readers (:mod:`.transfers`) and the own block fills the waits
(:func:`~.transfers.own_schedules`); :func:`~.layouts.make_layout` also numbers the ranks for
the shortest modelled call.

Short documents next to each other are first grouped into clusters (taken front to back), so
that many tiny documents do not scatter every rank over hundreds of position runs.

    ranges = balanced_ranges(world_size=4, seq_len=16384, documents=docs)
    ranges[0]  # [(0, 612), (4021, 4630), ...]: global [start, end) ranges of rank 0
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from ringray.attention.documents import Documents

# A document with more than 1/SPREAD_SHARE of a rank's mean work is spread over all ranks.
SPREAD_SHARE = 4
# A light document of at most 1/SHORT_SHARE of a rank's tokens is short: consecutive short
# documents are clustered up to 1/CLUSTER_SHARE of a rank's tokens.
SHORT_SHARE = 16
CLUSTER_SHARE = 8
# A rank keeps atomic items whole when its work then lands within this fraction of its target.
ATOMIC_SLACK = 0.002
# Tokens per run of a heavy document in :func:`run_ranges`.
RUN_UNIT = 64
# :func:`whole_ranges` keeps the runs construction only within this work imbalance.
RUNS_IMBALANCE = 1.01


@dataclass
class _Item:
    """A document (cut symmetrically: head, tail, head, ... from the outside in) or a cluster
    of short documents (cut front to back); ``taken`` tokens are already assigned."""

    start: int
    length: int
    symmetric: bool
    density: float
    taken: int = 0
    atomic: bool = False  # taken whole by one rank unless nothing else is left to take

    def work(self, prefix: list[int], t0: int, t1: int) -> int:
        """Work of the item's tokens number ``t0 .. t1 - 1`` in its taking order."""
        if not self.symmetric:
            return prefix[self.start + t1] - prefix[self.start + t0]
        return _symmetric_work(self.length, t1) - _symmetric_work(self.length, t0)

    def ranges(self, t0: int, t1: int) -> list[tuple[int, int]]:
        """Global ``[start, end)`` ranges of the item's tokens number ``t0 .. t1 - 1``."""
        if not self.symmetric:
            return [(self.start + t0, self.start + t1)]
        head = (self.start + (t0 + 1) // 2, self.start + (t1 + 1) // 2)
        end = self.start + self.length
        tail = (end - t1 // 2, end - t0 // 2)
        return [r for r in (head, tail) if r[1] > r[0]]


def _symmetric_work(length: int, taken: int) -> int:
    """Work of the first ``taken`` tokens of a document taken head, tail, head, ...: heads
    see 1, 2, ... keys, tails ``length``, ``length - 1``, ..."""
    heads, tails = (taken + 1) // 2, taken // 2
    return heads * (heads + 1) // 2 + tails * length - tails * (tails - 1) // 2


def _groups(documents: Documents, per_rank: int,
            heavy_work: float) -> list[tuple[int, int, int]]:
    """``(start, length, documents)`` per document, with consecutive short light documents
    (at most 1/SHORT_SHARE of a rank's tokens, at most ``heavy_work`` work) joined into
    clusters of up to 1/CLUSTER_SHARE of a rank's tokens, taken front to back."""
    short = max(1, per_rank // SHORT_SHARE)
    cluster_size = max(1, per_rank // CLUSTER_SHARE)
    groups: list[tuple[int, int, int]] = []
    open_start, open_len, open_docs = 0, 0, 0
    for start, length in zip(documents.bounds[:-1], documents.lengths, strict=True):
        if length > short or length * (length + 1) / 2 > heavy_work:  # one of its own
            if open_len:
                groups.append((open_start, open_len, open_docs))
            open_len = 0
            groups.append((start, length, 1))
            continue
        if open_len == 0:
            open_start, open_docs = start, 0
        open_len += length
        open_docs += 1
        if open_len >= cluster_size:
            groups.append((open_start, open_len, open_docs))
            open_len = 0
    if open_len:
        groups.append((open_start, open_len, open_docs))
    return groups


def _items(documents: Documents, per_rank: int, prefix: list[int],
           heavy_work: float) -> tuple[list[_Item], list[_Item]]:
    """``(heavy, light)``: documents with more than ``heavy_work`` work, in order; and the
    other documents, short ones clustered, densest first."""
    heavy: list[_Item] = []
    light: list[_Item] = []
    for start, length, count in _groups(documents, per_rank, heavy_work):
        work = prefix[start + length] - prefix[start]
        if count > 1:
            light.append(_Item(start, length, False, work / length))
        else:
            item = _Item(start, length, True, (length + 1) / 2)
            (heavy if work > heavy_work else light).append(item)
    light.sort(key=lambda item: (-item.density, item.start))
    return heavy, light


class _Remaining:
    """The items not yet assigned, densest first; ranks take from both ends."""

    def __init__(self, items: list[_Item], prefix: list[int]) -> None:
        self.items = items
        self.prefix = prefix
        self.front = 0
        self.back = len(items) - 1

    def _walk(self, amounts: dict[int, int], count: int, from_front: bool, cut: bool) -> int:
        """Add the next ``count`` tokens from one end to ``amounts``, passing over atomic
        items that do not fit whole unless ``cut``; returns how many it could not place."""
        index, step = (self.front, 1) if from_front else (self.back, -1)
        while count > 0 and self.front <= index <= self.back:
            item = self.items[index]
            left = item.length - item.taken - amounts.get(index, 0)
            x = min(count, left)
            if x > 0 and (cut or not item.atomic or x == left):
                amounts[index] = amounts.get(index, 0) + x
                count -= x
            index += step
        return count

    def plan(self, dense: int, total: int, cut: bool = True) -> dict[int, int]:
        """Tokens per item when ``dense`` of ``total`` come from the dense end (atomic items
        are cut only with ``cut``, or where nothing else is left)."""
        amounts: dict[int, int] = {}
        short = self._walk(amounts, dense, True, cut)
        short = self._walk(amounts, total - dense + short, False, cut)
        if short:
            self._walk(amounts, short, False, True)
        return amounts

    def work(self, amounts: dict[int, int]) -> int:
        total = 0
        for index, x in amounts.items():
            item = self.items[index]
            total += item.work(self.prefix, item.taken, item.taken + x)
        return total

    def take(self, amounts: dict[int, int]) -> list[tuple[int, int]]:
        """Assign ``amounts``; returns the global ranges taken."""
        ranges = []
        for index, x in amounts.items():
            item = self.items[index]
            ranges += item.ranges(item.taken, item.taken + x)
            item.taken += x
        while self.front <= self.back and self.items[self.front].taken == \
                self.items[self.front].length:
            self.front += 1
        while self.back >= self.front and self.items[self.back].taken == \
                self.items[self.back].length:
            self.back -= 1
        return ranges


def balanced_ranges(
    world_size: int, seq_len: int, documents: Documents, *, spread: bool = True,
    prefix: list[int] | None = None,
) -> list[list[tuple[int, int]]]:
    """Per rank, sorted disjoint global ``[start, end)`` ranges: ``seq_len / world_size``
    tokens each, with near-equal causal work under the document mask (see the module
    docstring). ``seq_len`` must be a multiple of ``world_size`` (checked by the caller).

    ``spread=False`` (the ``whole`` layout): no document is spread over every rank; every
    document goes through the two pointers, so it stays on one rank unless a rank's share
    runs out inside it, and a long one is cut into as few nested head/tail pieces as the
    shares need. Work stays as equal; fewer ranks share each document, so a rank reads keys
    from fewer others (and only their rows of the documents it holds). ``prefix``:
    :func:`_work_prefix` of ``documents``, if the caller has it."""
    per_rank = seq_len // world_size
    prefix = _work_prefix(documents) if prefix is None else prefix
    heavy_work = prefix[-1] / (world_size * SPREAD_SHARE) if spread else float("inf")
    heavy, light = _items(documents, per_rank, prefix, heavy_work)
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    tokens, work = [0] * world_size, [0] * world_size
    for doc in heavy:  # zigzag over all ranks: rank r takes the r-th nested head/tail pair
        share = 2 * (doc.length // (2 * world_size))  # even: equal halves, equal work
        for rank in range(world_size):
            ranges[rank] += doc.ranges(doc.taken, doc.taken + share)
            work[rank] += doc.work(prefix, doc.taken, doc.taken + share)
            tokens[rank] += share
            doc.taken += share
    # What a spread document leaves (its middle, fewer than 2N tokens) is filled in as light.
    light = sorted(light + [doc for doc in heavy if doc.taken < doc.length],
                   key=lambda item: (-item.density, item.start))
    remaining = _Remaining(light, prefix)
    _deal(remaining, per_rank, prefix[-1] - sum(work), tokens, work, ranges)
    return [_merge(rank_ranges) for rank_ranges in ranges]


def whole_ranges(world_size: int, seq_len: int,
                 documents: Documents) -> list[list[tuple[int, int]]]:
    """The ``whole`` layout's ranges: of two constructions with equal work, the one whose
    ranks read fewer keys from one another (:func:`received_rows`), as
    :func:`balanced_ranges` returns them. One is :func:`balanced_ranges` with
    ``spread=False`` (nested pieces); the other :func:`run_ranges` (light documents whole,
    heavy ones in runs). The second wins only if its work imbalance is within
    :data:`RUNS_IMBALANCE`."""
    prefix = _work_prefix(documents)
    nested = balanced_ranges(world_size, seq_len, documents, spread=False, prefix=prefix)
    runs = run_ranges(world_size, seq_len, documents, prefix=prefix)
    if (_imbalance(runs, prefix) <= max(RUNS_IMBALANCE, _imbalance(nested, prefix))
            and received_rows(runs, documents) < received_rows(nested, documents)):
        return runs
    return nested


def run_ranges(world_size: int, seq_len: int, documents: Documents, *,
               prefix: list[int] | None = None) -> list[list[tuple[int, int]]]:
    """Light documents whole, heavy ones cut into runs (see the module docstring).

    A document with more work than a rank's mean is heavy: it is cut into runs of
    :data:`RUN_UNIT` consecutive positions, each an item of its own density, so that the
    two pointers hand its highest positions to the ranks that need dense work and its
    lowest to those that need tokens. Every other document (and cluster of short ones) is
    atomic: a rank takes it whole or leaves it to the next, and cuts it only when no take
    of whole items lands within :data:`ATOMIC_SLACK` of its work. A light document longer
    than a rank's share is first cut into the fewest equal consecutive pieces that fit.
    ``prefix``: :func:`_work_prefix` of ``documents``, if the caller has it."""
    per_rank = seq_len // world_size
    prefix = _work_prefix(documents) if prefix is None else prefix
    heavy_work = prefix[-1] / world_size
    items: list[_Item] = []
    for start, length, _ in _groups(documents, per_rank, heavy_work):
        work = prefix[start + length] - prefix[start]
        heavy = work > heavy_work
        pieces = 1 if heavy else -(-length // per_rank)
        step = RUN_UNIT if heavy else None
        cuts = (list(range(0, length, step)) + [length] if step
                else [length * i // pieces for i in range(pieces + 1)])
        for a, b in itertools.pairwise(cuts):
            piece_work = prefix[start + b] - prefix[start + a]
            items.append(_Item(start + a, b - a, False, piece_work / (b - a), atomic=not heavy))
    items.sort(key=lambda item: (-item.density, item.start))
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    _deal(_Remaining(items, prefix), per_rank, prefix[-1], [0] * world_size,
          [0] * world_size, ranges)
    return [_merge(rank_ranges) for rank_ranges in ranges]


def received_rows(ranges: list[list[tuple[int, int]]], documents: Documents) -> int:
    """Keys the ranks of a layout read from one another under the causal document mask:
    for every rank and document it holds part of, the positions up to its highest one there
    that other ranks hold (the rows :mod:`.transfers` sends it)."""
    bounds = documents.bounds
    total = 0
    for rank_ranges in ranges:
        top: dict[int, int] = {}
        own: dict[int, int] = {}
        for start, end in rank_ranges:
            doc = bisect.bisect_right(bounds, start) - 1
            while start < end:
                stop = min(end, bounds[doc + 1])
                top[doc] = max(top.get(doc, 0), stop - bounds[doc])
                own[doc] = own.get(doc, 0) + stop - start
                start, doc = stop, doc + 1
        total += sum(top[doc] - own[doc] for doc in top)
    return total


def _work_prefix(documents: Documents) -> list[int]:
    """Causal work (visible keys) of positions ``0 .. p - 1`` at index ``p``."""
    return [0, *torch.cumsum(documents.token_work(causal=True), 0).tolist()]


def _imbalance(ranges: list[list[tuple[int, int]]], prefix: list[int]) -> float:
    """Max over mean of the ranks' work (``prefix``: :func:`_work_prefix`)."""
    totals = [sum(prefix[end] - prefix[start] for start, end in rank) for rank in ranges]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean else 1.0


def _deal(remaining: _Remaining, per_rank: int, left_work: int, tokens: list[int],
          work: list[int], ranges: list[list[tuple[int, int]]]) -> None:
    """Fill every rank up to ``per_rank`` tokens from ``remaining`` (whose items hold
    ``left_work``), rank by rank, each topped up to the mean total work of the ranks still
    to fill; the last takes what is left."""
    world_size = len(ranges)
    for rank in range(world_size):
        room = per_rank - tokens[rank]
        if rank == world_size - 1:
            amounts = remaining.plan(room, room)
        else:  # top this rank up to the mean total work of the ranks still to fill
            target = (left_work + sum(work[rank:])) / (world_size - rank) - work[rank]
            amounts = _best_split(remaining, room, target)
        taken_work = remaining.work(amounts)
        left_work -= taken_work
        work[rank] += taken_work
        tokens[rank] += room
        ranges[rank] += remaining.take(amounts)


def _best_split(remaining: _Remaining, count: int, target: float) -> dict[int, int]:
    """The take of ``count`` tokens whose work is closest to ``target``: a binary search
    for the number from the dense end (work grows with it, up to one token's jitter), then
    a look at the neighbours. Atomic items are kept whole where that lands within
    :data:`ATOMIC_SLACK` of the target; otherwise the closest take with cuts wins."""
    best, best_error = {}, float("inf")
    for cut in (False, True):
        lo, hi = 0, count
        while lo < hi:
            mid = (lo + hi) // 2
            if remaining.work(remaining.plan(mid, count, cut)) < target:
                lo = mid + 1
            else:
                hi = mid
        for dense in range(max(0, lo - 2), min(count, lo + 2) + 1):
            amounts = remaining.plan(dense, count, cut)
            error = abs(remaining.work(amounts) - target)
            if error < best_error:
                best, best_error = amounts, error
        if best_error <= ATOMIC_SLACK * target:
            break
    return best


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with touching ones joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged
