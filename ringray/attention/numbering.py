"""The layout optimiser's second half (beside :mod:`.balance`, which chooses each rank's
share): which rank holds which share, so that the ring's rounds wait least.

    order = best_numbering(work)     # work: a block-work matrix, [reader][source] pairs

Renumbering a layout's ranks changes neither the work per rank nor the bytes, but it changes
who exchanges with whom in which round, and so how long a rank balanced in total but not per
step waits for its peers. Of :data:`NUMBERINGS` numberings (as given, then seeded shuffles:
the same on every rank), the one with the shortest modelled call
(:func:`~.transfer_plan.modelled_time`) is kept. Plain numbers in and out: the layout
(:mod:`.layouts`, pure geometry) computes the matrix and applies the order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ringray.attention.transfer_plan import modelled_time

NUMBERINGS = 32
"""Numberings tried (the first: as given)."""
NUMBERING_MAX_RANKS = 16
"""Rings of more ranks keep the numbering as given (the model's cost grows with the ring)."""


def best_numbering(work: Sequence[Sequence[int]]) -> list[int]:
    """The order of ranks (``order[new] = old``) whose ring call the timeline model finds
    shortest, for a block-work matrix ``work`` (``[reader][source]`` visible pairs); the
    identity for rings of at most 2 or more than :data:`NUMBERING_MAX_RANKS` ranks."""
    world = len(work)
    identity = list(range(world))
    if world <= 2 or world > NUMBERING_MAX_RANKS:
        return identity
    rng = random.Random(0)
    best, best_time = identity, modelled_time(work)
    for _ in range(NUMBERINGS - 1):
        order = list(range(world))
        rng.shuffle(order)
        time = modelled_time([[work[a][b] for b in order] for a in order])
        if time < best_time:
            best, best_time = order, time
    return best
