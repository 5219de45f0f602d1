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

The ``whole`` layout (``spread=False``) skips the spreading: heavy documents go through the
two pointers like the others. A document then lives on one rank unless a rank's share runs
out inside it, and the few it is cut over (nested head/tail pieces, so work still follows
tokens) are the only ranks that read one another's keys of it. Its work is as equal in total;
it is not equal at every ring step, which matters less once each block goes only to its
readers (:mod:`.transfers`).

Short documents next to each other are first grouped into clusters (taken front to back), so
that many tiny documents do not scatter every rank over hundreds of position runs.

    ranges = balanced_ranges(world_size=4, seq_len=16384, documents=docs)
    ranges[0]  # [(0, 612), (4021, 4630), ...]: global [start, end) ranges of rank 0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringray.attention.documents import Documents

# A document with more than 1/SPREAD_SHARE of a rank's mean work is spread over all ranks.
SPREAD_SHARE = 4
# A light document of at most 1/SHORT_SHARE of a rank's tokens is short: consecutive short
# documents are clustered up to 1/CLUSTER_SHARE of a rank's tokens.
SHORT_SHARE = 16
CLUSTER_SHARE = 8


@dataclass
class _Item:
    """A document (cut symmetrically: head, tail, head, ... from the outside in) or a cluster
    of short documents (cut front to back); ``taken`` tokens are already assigned."""

    start: int
    length: int
    symmetric: bool
    density: float
    taken: int = 0

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


def _items(documents: Documents, per_rank: int, prefix: list[int],
           heavy_work: float) -> tuple[list[_Item], list[_Item]]:
    """``(heavy, light)``: documents with more than ``heavy_work`` work, in order; and the
    other documents, short ones clustered, densest first."""
    short = max(1, per_rank // SHORT_SHARE)
    cluster_size = max(1, per_rank // CLUSTER_SHARE)
    heavy: list[_Item] = []
    light: list[_Item] = []
    open_start, open_len, open_docs = 0, 0, 0

    def close() -> None:
        if open_len:
            work = prefix[open_start + open_len] - prefix[open_start]
            light.append(_Item(open_start, open_len, open_docs == 1, work / open_len))

    for start, length in zip(documents.bounds[:-1], documents.lengths, strict=True):
        is_heavy = length * (length + 1) / 2 > heavy_work
        if is_heavy or length > short:  # a document of its own
            close()
            open_len = 0
            (heavy if is_heavy else light).append(_Item(start, length, True, (length + 1) / 2))
            continue
        if open_len == 0:
            open_start, open_docs = start, 0
        open_len += length
        open_docs += 1
        if open_len >= cluster_size:
            close()
            open_len = 0
    close()
    light.sort(key=lambda item: (-item.density, item.start))
    return heavy, light


class _Remaining:
    """The items not yet assigned, densest first; ranks take from both ends."""

    def __init__(self, items: list[_Item], prefix: list[int]) -> None:
        self.items = items
        self.prefix = prefix
        self.front = 0
        self.back = len(items) - 1

    def _walk(self, count: int, from_front: bool) -> list[tuple[int, int]]:
        """(item index, tokens) for the next ``count`` tokens from one end."""
        takes: list[tuple[int, int]] = []
        index, step = (self.front, 1) if from_front else (self.back, -1)
        while count > 0:
            item = self.items[index]
            x = min(count, item.length - item.taken)
            if x > 0:
                takes.append((index, x))
                count -= x
            index += step
        return takes

    def plan(self, dense: int, total: int) -> dict[int, int]:
        """Tokens per item when ``dense`` of ``total`` come from the dense end."""
        amounts: dict[int, int] = {}
        for index, x in self._walk(dense, True) + self._walk(total - dense, False):
            amounts[index] = amounts.get(index, 0) + x
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
    world_size: int, seq_len: int, documents: Documents, *, spread: bool = True
) -> list[list[tuple[int, int]]]:
    """Per rank, sorted disjoint global ``[start, end)`` ranges: ``seq_len / world_size``
    tokens each, with near-equal causal work under the document mask (see the module
    docstring). ``seq_len`` must be a multiple of ``world_size`` (checked by the caller).

    ``spread=False`` (the ``whole`` layout): no document is spread over every rank; every
    document goes through the two pointers, so it stays on one rank unless a rank's share
    runs out inside it, and a long one is cut into as few nested head/tail pieces as the
    shares need. Work stays as equal; fewer ranks share each document, so a rank reads keys
    from fewer others (and only their rows of the documents it holds)."""
    per_rank = seq_len // world_size
    prefix = [0, *torch.cumsum(documents.token_work(causal=True), 0).tolist()]
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
    left_work = prefix[-1] - sum(work)  # of the light documents
    for rank in range(world_size):
        room = per_rank - tokens[rank]
        if rank == world_size - 1:
            amounts = remaining.plan(room, room)
        else:  # top this rank up to the mean total work of the ranks still to fill
            target = (left_work + sum(work[rank:])) / (world_size - rank) - work[rank]
            amounts = _best_split(remaining, room, target)
        left_work -= remaining.work(amounts)
        ranges[rank] += remaining.take(amounts)
    return [_merge(rank_ranges) for rank_ranges in ranges]


def _best_split(remaining: _Remaining, count: int, target: float) -> dict[int, int]:
    """The take of ``count`` tokens whose work is closest to ``target``: a binary search
    for the number from the dense end (work grows with it, up to one token's jitter), then
    a look at the neighbours."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) // 2
        if remaining.work(remaining.plan(mid, count)) < target:
            lo = mid + 1
        else:
            hi = mid
    best, best_error = {}, float("inf")
    for dense in range(max(0, lo - 2), min(count, lo + 2) + 1):
        amounts = remaining.plan(dense, count)
        error = abs(remaining.work(amounts) - target)
        if error < best_error:
            best, best_error = amounts, error
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
