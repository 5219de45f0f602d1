"""How few bytes can a layout send under a document mask, at a given work imbalance? A local
search from the ``whole`` layout (issue 27): evidence about the goal, not a layout ringray uses.

    python benchmarks/layout_search.py                      # stdlib mix, S = 64k, N = 4 and 8
    python benchmarks/layout_search.py --worlds 4 --tolerances 1.02 --iterations 100000

What a ring sends under the mask (:mod:`ringray.attention.transfers`) is, per document, for
each rank that holds part of it, the document's keys before that rank's last query in it
that other ranks hold: ``max + 1 - own`` rows, where ``max`` is the rank's highest position
in the document and ``own`` its tokens there. Only each rank's highest position per document
and its token count matter, not how the tokens below are spread. The search uses that:

- The sequence is cut into units of ``--unit`` tokens inside documents. Each unit starts on
  the rank of ``whole`` that holds most of it.
- A move swaps two units of the same size on two ranks (token counts do not change). It is
  kept when it lowers the rows and no rank's work (visible query-key pairs) goes over
  ``tolerance`` times the mean; a move that raises the rows is kept with probability
  ``exp(-rise / T)`` (``--temperature``, falling linearly to 0).
- Rounding to units leaves some ranks a few tokens over their share: those are handed to
  ranks under it, preferring tokens below the receiver's own highest position in their
  document (which costs no rows).

The result is scored as ``benchmarks/ring_transfers.py`` scores a layout (the transfer plan's
bytes, forward and backward, bf16 K/V and float32 dK/dV, against the plain ring; the work
imbalance from :func:`ringray.attention.block_work`), next to ``whole`` on the same
documents. Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ring_transfers import sent_ratio  # noqa: E402

from ringray.attention import make_layout  # noqa: E402
from ringray.bench.ring import document_lengths  # noqa: E402


class _Search:
    """Units, their owners, and each (rank, document)'s rows, kept up to date per move."""

    def __init__(self, world: int, seq: int, lengths: list[int], unit: int) -> None:
        self.world, self.seq, self.lengths = world, seq, lengths
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        layout = make_layout("whole", world, seq, documents=lengths)
        owner = np.empty(seq, dtype=np.int64)
        for rank in range(world):
            owner[layout.positions(rank).numpy()] = rank
        spans = [(d, a, min(a + unit, s + n))
                 for d, (s, n) in enumerate(zip(self.starts.tolist(), lengths, strict=True))
                 for a in range(s, s + n, unit)]
        self.doc = np.array([d for d, _, _ in spans])
        self.begin = np.array([a for _, a, _ in spans])
        self.size = np.array([b - a for _, a, b in spans])
        offset = np.arange(seq) - np.repeat(self.starts, lengths) + 1  # keys each query sees
        self.work = np.array([offset[a:b].sum() for _, a, b in spans], dtype=np.float64)
        self.owner = np.array([np.bincount(owner[a:b], minlength=world).argmax()
                               for _, a, b in spans])
        self.rank_work = np.bincount(self.owner, weights=self.work, minlength=world)
        self.of_doc = [np.nonzero(self.doc == d)[0] for d in range(len(lengths))]
        self.rows = {(r, d): self._rows(r, d) for r in range(world) for d in range(len(lengths))}

    def _rows(self, rank: int, doc: int) -> int:
        units = self.of_doc[doc]
        mine = units[self.owner[units] == rank]
        if len(mine) == 0:
            return 0
        last = self.begin[mine[-1]] + self.size[mine[-1]] - 1 - self.starts[doc]
        return int(last + 1 - self.size[mine].sum())

    def total_rows(self) -> int:
        return sum(self.rows.values())

    def run(self, tolerance: float, iterations: int, temperature: float, seed: int) -> None:
        rng = random.Random(seed)
        limit = tolerance * self.rank_work.sum() / self.world
        by_size: dict[int, list[int]] = {}
        for index, size in enumerate(self.size):
            by_size.setdefault(int(size), []).append(index)
        for step in range(iterations):
            i = rng.randrange(len(self.size))
            j = rng.choice(by_size[int(self.size[i])])
            a, b = self.owner[i], self.owner[j]
            if a == b:
                continue
            shift = self.work[j] - self.work[i]
            if max(self.rank_work[a] + shift, self.rank_work[b] - shift) > limit:
                continue
            keys = {(a, self.doc[i]), (b, self.doc[i]), (a, self.doc[j]), (b, self.doc[j])}
            before = sum(self.rows[k] for k in keys)
            self.owner[i], self.owner[j] = b, a
            after = {k: self._rows(*k) for k in keys}
            rise = sum(after.values()) - before
            heat = temperature * (1 - step / iterations)
            if rise <= 0 or (heat > 0 and rng.random() < math.exp(-rise / heat)):
                self.rows.update(after)
                self.rank_work[a] += shift
                self.rank_work[b] -= shift
            else:
                self.owner[i], self.owner[j] = a, b

    def positions(self) -> list[list[int]]:
        """Per rank, its tokens, with the counts made equal (see the module docstring)."""
        owner = np.empty(self.seq, dtype=np.int64)
        for index, rank in enumerate(self.owner):
            owner[self.begin[index]:self.begin[index] + self.size[index]] = rank
        share = self.seq // self.world
        doc_of = np.repeat(np.arange(len(self.lengths)), self.lengths)
        while True:
            counts = np.bincount(owner, minlength=self.world)
            over = [r for r in range(self.world) if counts[r] > share]
            if not over:
                break
            giver = over[0]
            taker = next(r for r in range(self.world) if counts[r] < share)
            moves = min(counts[giver] - share, share - counts[taker])
            top: dict[int, int] = {}
            for token in np.nonzero(owner == taker)[0]:
                top[int(doc_of[token])] = int(token)
            mine = np.nonzero(owner == giver)[0]
            free = [t for t in mine if doc_of[t] in top and t < top[doc_of[t]]]
            rest = np.setdiff1d(mine, free, assume_unique=True).tolist()
            owner[np.array((free + rest)[:moves])] = taker
        return [np.nonzero(owner == rank)[0].tolist() for rank in range(self.world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", default="stdlib")
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--tolerances", default="1.01,1.02,1.05")
    parser.add_argument("--unit", type=int, default=64, help="tokens per unit moved")
    parser.add_argument("--iterations", type=int, default=400_000)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="rows a move may add at the start, on the exp(-rise/T) rule")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = document_lengths(args.documents, args.seq)
    print(f"documents {args.documents}, S = {args.seq}: {len(lengths)} documents, longest "
          f"{max(lengths)}")
    print("| N | tolerance | whole: bytes / plain ring | imbalance | search: bytes / plain ring "
          "| worst rank | imbalance |")
    print("|---|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        whole = sent_ratio("whole", world, args.seq, lengths, None)
        for tolerance in (float(t) for t in args.tolerances.split(",")):
            search = _Search(world, args.seq, lengths, args.unit)
            search.run(tolerance, args.iterations, args.temperature, args.seed)
            found = sent_ratio(search.positions(), world, args.seq, lengths, None)
            print(f"| {world} | {tolerance} | {whole['total']:.1%} | {whole['imbalance']:.3f} "
                  f"| {found['total']:.1%} | {found['worst']:.1%} | {found['imbalance']:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
