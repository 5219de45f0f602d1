"""Which K/V blocks travel where in a ring call: each block goes only to the ranks that read it.

    plan = plan_transfers(layout, causal=True, documents=docs)
    plan.reads[r][s]         # rank r's queries see some key of rank s's block
    plan.rows_read(s, r)     # which rows of rank s's block: local [start, end) ranges
    plan.rounds              # per round, (source, reader) pairs: the block source -> reader
    plan.forward_steps(r)    # what rank r posts, computes and waits for, step by step
    plan.backward_steps(r)

The rule. From the layout and the mask (causal, packed documents, a sliding window) every
rank knows, before anything moves, which (query block, key block) pairs hold a visible pair
(:func:`~.layouts.block_work` > 0). A block is sent to exactly the ranks whose queries see
one of its keys, *directly* from its owner (point to point, not relayed round a ring), and
the dK/dV partial sum a reader computes for it goes straight back to the owner. Only the
*rows* of the block that the reader reads travel (:func:`read_rows`: the keys some query of
the reader sees), and only those rows of the dK/dV sum come back: a key no query of the
reader sees has a zero gradient there. Nothing is sent that nobody reads. With one document
over the whole sequence and causal zigzag every rank reads every block, and the plan is the
plain ring's N - 1 messages per rank, each sent from its owner at ring distance 1, 2, ...
(round t: rank r receives rank r - t's block); a rank later in the ring than the block's
owner reads only the owner's early chunk, so those messages carry half a block.

Rounds. The (source, reader) pairs are grouped into rounds in which every rank sends at most
one block and receives at most one (a matching: :func:`~.transfer_plan.transfer_rounds`), so
a rank needs two receive buffers whatever the pattern (one computed on, one filling), and in
the backward one buffer for an incoming dK/dV sum. Each round is filled greedily by
augmenting paths, readers with the most blocks still to come first and nearer ring distances
preferred, so a
rank's receives come in its first rounds, one after another, and each transfer hides behind
the previous block's compute.

Steps. A rank posts one round's messages, computes the block it received in its previous
round (or its own block first), and waits; rounds in which it neither sends nor receives are
skipped, so a rank that reads little does little. A message completes only once both its
ranks have posted it, so a layout balanced in total but not per step makes ranks wait for
busy peers; the own block, which needs no message, then fills those waits instead of being
computed first (:func:`~.transfer_plan.own_schedules`). Every rank posts its rounds in the same
(ascending) order and each round's sends and receives pair up within the round, so no rank
waits on a message that its peer posts only later: no deadlock, on gloo or NCCL.

The backward runs the rounds in reverse: it starts with the block the forward received last
(kept alive from the forward, so not sent again) and ends with the rank's own block, so the
last dK/dV sum sent back to an owner travels while the own block is computed. The exchange
of backward round u carries the K/V blocks of forward round u - 1 (needed next) and the dK/dV
sums of round u + 1 (just computed). Compared with the plain ring (which relays blocks
through every rank), a rank keeps its own K/V block alive through the backward (one block at
the kv-head count), and in exchange never receives its own block back: with every block
read, the forward sends N - 1 blocks, the backward N - 2 blocks and N - 1 dK/dV sums.

Pure: plain data in, frozen dataclasses out; tested without processes
(``tests/test_transfers.py``).
"""

from __future__ import annotations

import torch

from ringray.attention.documents import Documents
from ringray.attention.layouts import Layout, block_work
from ringray.attention.transfer_plan import Pair, Rows, TransferPlan, transfer_rounds


def plan_transfers(
    layout: Layout, causal: bool, documents: Documents | None = None,
    window: int | None = None, *, every_block: bool = False,
) -> TransferPlan:
    """The :class:`TransferPlan` of a ring call over ``layout`` (its ring: one block per
    rank) under the mask: causal or not, packed ``documents``, a sliding ``window``.

    ``every_block``: the plain ring's traffic instead, for comparison: every block goes
    whole to every rank (round t: ring distance t), read or not."""
    if every_block:
        world = layout.world_size
        reads = tuple(tuple(True for _ in range(world)) for _ in range(world))
        return TransferPlan(world_size=world, reads=reads, rounds=transfer_rounds(reads),
                            block_rows=layout.local_len)
    work = block_work(layout, documents, causal=causal, window=window)
    reads = tuple(tuple(pairs > 0 for pairs in row) for row in work)
    rows = read_rows(layout, causal, documents, window)
    partial = tuple(((source, reader), ranges) for (source, reader), ranges in rows.items()
                    if ranges != ((0, layout.local_len),) and reads[reader][source])
    return TransferPlan(world_size=layout.world_size, reads=reads,
                        rounds=transfer_rounds(reads), partial_rows=partial,
                        block_rows=layout.local_len, work=tuple(map(tuple, work)))


def read_rows(
    layout: Layout, causal: bool, documents: Documents | None = None,
    window: int | None = None,
) -> dict[Pair, Rows]:
    """For every ``(source, reader)`` pair of distinct ranks, the local rows of ``source``'s
    block that some query of ``reader`` sees, as ``[start, end)`` ranges (empty: none).

    A key at global position ``p`` is seen by ``reader`` when one of its queries is in the
    same document and, causal, at ``p`` or later (with a window, at most ``window - 1``
    later): the first of the reader's queries at or after ``p`` decides, as queries further
    on are further away. Not causal: any query of the reader in ``p``'s document."""
    docs = documents if documents is not None else Documents((layout.seq_len,))
    ids = docs.ids
    rows: dict[Pair, Rows] = {}
    for reader in range(layout.world_size):
        queries = torch.sort(layout.positions(reader)).values
        has_doc = torch.zeros(len(docs.lengths), dtype=torch.bool)
        has_doc[ids[queries]] = True
        for source in range(layout.world_size):
            if source == reader:
                continue
            keys = layout.positions(source)
            if causal:
                after = torch.searchsorted(queries, keys)
                exists = after < len(queries)
                first = queries[after.clamp(max=len(queries) - 1)]
                seen = exists & (ids[first] == ids[keys])
                if window is not None:
                    seen &= first - keys <= window - 1
            else:
                seen = has_doc[ids[keys]]
            rows[source, reader] = _ranges(seen)
    return rows


def _ranges(mask: torch.Tensor) -> Rows:
    """The ``[start, end)`` runs of True in a 1-D boolean tensor."""
    edges = torch.diff(mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return tuple(zip(starts, ends, strict=True))
