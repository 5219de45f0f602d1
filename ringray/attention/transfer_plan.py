"""The transfer plan and its timeline model, apart from any layout: who sends which K/V
block to whom in which round (:class:`TransferPlan`, :func:`transfer_rounds`), each rank's
steps (:class:`Step`: one ring step), and where a rank computes its own block
(:func:`own_schedules`, a timeline model of the call, also :func:`modelled_time`, which the
layout optimiser uses to number a layout's ranks: :mod:`.numbering`). Plain data in, frozen
dataclasses out; nothing here imports a layout. :func:`.transfers.plan_transfers` builds a
plan from a layout and a mask (the rule is described there).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

Pair = tuple[int, int]  # (source, reader): the source's K/V block goes to the reader
Rows = tuple[tuple[int, int], ...]  # local [start, end) row ranges of a source's block


@dataclass(frozen=True)
class Exchange:
    """One rank's messages in one round (peers are ranks of the ring; ``None``: none)."""

    kv_from: int | None = None  # receive this rank's K/V block
    kv_to: int | None = None  # send the own K/V block to this rank
    dkv_from: int | None = None  # receive this reader's dK/dV partial sum of the own block
    dkv_to: int | None = None  # send this source the dK/dV partial sum of its block

    @property
    def empty(self) -> bool:
        return (self.kv_from, self.kv_to, self.dkv_from, self.dkv_to) == (None,) * 4


@dataclass(frozen=True)
class Step:
    """Post ``exchange`` (``None``: nothing to post), compute against the K/V block that
    started on rank ``block`` (``None``: nothing to compute), then wait for the exchange.
    ``round``: the plan's round the exchange belongs to (forward 1, 2, ...; backward the
    forward round whose block it computes), ``None`` without one."""

    exchange: Exchange | None
    block: int | None
    round: int | None = None


@dataclass(frozen=True)
class TransferCounts:
    """Messages one rank sends in one ring call, and what the plain ring would send."""

    forward_kv: int
    backward_kv: int
    backward_dkv: int
    ring_forward: int  # the plain ring's: N - 1 K/V blocks
    ring_backward: int  # the plain ring's: N - 1 K/V blocks and N - 1 dK/dV sums
    # Rows (keys) of those messages: a block has ``block_rows``; a reader gets only the
    # rows it reads, and sends back only those rows of the dK/dV sum.
    forward_kv_rows: int = 0
    backward_kv_rows: int = 0
    backward_dkv_rows: int = 0
    block_rows: int = 0

    def bytes_sent(self, kv_row_bytes: int, dkv_row_bytes: int) -> int:
        """Bytes this rank sends in one call (forward and backward), for a K/V row
        (K and V, all heads) of ``kv_row_bytes`` and a dK/dV row of ``dkv_row_bytes``."""
        return ((self.forward_kv_rows + self.backward_kv_rows) * kv_row_bytes
                + self.backward_dkv_rows * dkv_row_bytes)

    def ring_bytes(self, kv_row_bytes: int, dkv_row_bytes: int) -> int:
        """What the plain ring sends per rank and call: whole blocks, N - 1 of each."""
        return self.block_rows * self.ring_forward * (2 * kv_row_bytes + dkv_row_bytes)

    @property
    def forward_skipped(self) -> int:
        return self.ring_forward - self.forward_kv

    @property
    def backward_skipped(self) -> int:
        return self.ring_backward - self.backward_kv - self.backward_dkv


@dataclass(frozen=True)
class TransferPlan:
    """Who sends which K/V block to whom, in which round, for one ring call's mask."""

    world_size: int
    reads: tuple[tuple[bool, ...], ...]  # [reader][source]
    rounds: tuple[tuple[Pair, ...], ...]  # forward rounds 1, 2, ...: (source, reader) pairs
    # ((source, reader), rows) for every pair that reads less than the whole block;
    # a pair not listed reads all ``block_rows`` rows.
    partial_rows: tuple[tuple[Pair, Rows], ...] = ()
    block_rows: int = 0
    # Visible query-key pairs per block pair, [reader][source] (:func:`~.layouts.block_work`);
    # empty when unknown (then the own block keeps its classic place: see own_schedule).
    work: tuple[tuple[int, ...], ...] = ()

    @cached_property
    def _rows(self) -> dict[Pair, Rows]:
        return dict(self.partial_rows)

    def rows_read(self, source: int, reader: int) -> Rows:
        """The local row ranges of ``source``'s block that ``reader`` reads (the whole
        block, ``((0, block_rows),)``, unless the mask leaves some rows unread)."""
        return self._rows.get((source, reader), ((0, self.block_rows),))

    def is_partial(self, source: int, reader: int) -> bool:
        """Whether ``reader`` reads only some rows of ``source``'s block."""
        return (source, reader) in self._rows

    def row_count(self, source: int, reader: int) -> int:
        return sum(end - start for start, end in self.rows_read(source, reader))

    @cached_property
    def _received_in(self) -> tuple[dict[int, int], ...]:
        """Per rank: forward round (1-based) -> the source whose block it receives then."""
        table: tuple[dict[int, int], ...] = tuple({} for _ in range(self.world_size))
        for index, pairs in enumerate(self.rounds, start=1):
            for source, reader in pairs:
                table[reader][index] = source
        return table

    def last_received(self, rank: int) -> int | None:
        """The forward round in which ``rank`` receives its last block (``None``: none);
        that block is kept for the start of the backward and not sent again."""
        rounds = self._received_in[rank]
        return max(rounds) if rounds else None

    def _round(self, index: int) -> tuple[Pair, ...]:
        return self.rounds[index - 1] if 1 <= index <= len(self.rounds) else ()

    @cached_property
    def _steps(self) -> dict[tuple[str, int], tuple[Step, ...]]:
        """Every rank's steps, built once per plan (a ring call asks for them every time)."""
        return {(phase, rank): build(rank) for rank in range(self.world_size)
                for phase, build in (("forward", self._forward_steps),
                                     ("backward", self._backward_steps))}

    def forward_steps(self, rank: int) -> tuple[Step, ...]:
        """``rank``'s forward: its own block first, then each received block, one step
        after the round that brought it."""
        return self._steps["forward", rank]

    def backward_steps(self, rank: int) -> tuple[Step, ...]:
        """``rank``'s backward: rounds in reverse, ending with its own block. Backward
        round u computes the block received in forward round u (round 0: the own block) and
        carries round u - 1's K/V blocks and round u + 1's dK/dV sums."""
        return self._steps["backward", rank]

    def _forward_steps(self, rank: int) -> tuple[Step, ...]:
        exchanges = []
        for index in range(1, len(self.rounds) + 1):
            kv_from = self._received_in[rank].get(index)
            kv_to = next((r for s, r in self.rounds[index - 1] if s == rank), None)
            if kv_from is not None or kv_to is not None:
                exchanges.append((index, Exchange(kv_from=kv_from, kv_to=kv_to)))
        steps, block = [], rank
        for index, exchange in exchanges:
            steps.append(Step(exchange, block, index))
            block = exchange.kv_from
        if block is not None:
            steps.append(Step(None, block))
        return tuple(steps)

    def _backward_steps(self, rank: int) -> tuple[Step, ...]:
        last = {r: self.last_received(r) for r in range(self.world_size)}
        steps = []
        for index in range(len(self.rounds), -1, -1):
            kv = [(s, r) for s, r in self._round(index - 1) if last[r] != index - 1]
            dkv = self._round(index + 1)
            exchange = Exchange(
                kv_from=next((s for s, r in kv if r == rank), None),
                kv_to=next((r for s, r in kv if s == rank), None),
                dkv_from=next((r for s, r in dkv if s == rank), None),
                dkv_to=next((s for s, r in dkv if r == rank), None),
            )
            block = self._received_in[rank].get(index) if index else rank
            if not exchange.empty or block is not None:
                steps.append(Step(None, block) if exchange.empty else
                             Step(exchange, block, index))
        return tuple(steps)

    def own_schedule(self, rank: int, phase: str) -> tuple[int, ...] | None:
        """When ``rank`` computes its own block in ``phase`` (``"forward"`` or
        ``"backward"``): per step of its steps, the own block's visible pairs computed by the
        end of that step (cumulative; the last is the whole block). ``None``: the classic
        place, the first forward step and the last backward step (see :func:`own_schedules`).
        """
        schedules = self._own_schedules[phase]
        return None if schedules is None else schedules[rank]

    @cached_property
    def _own_schedules(self) -> dict[str, tuple[tuple[int, ...], ...] | None]:
        return {phase: own_schedules(self, phase) for phase in ("forward", "backward")}

    def counts(self, rank: int) -> TransferCounts:
        """Messages ``rank`` sends in one call (forward and backward), beside the ring's."""
        def sent(steps: tuple[Step, ...], field: str) -> list[int]:
            return [getattr(s.exchange, field) for s in steps
                    if s.exchange and getattr(s.exchange, field) is not None]

        forward, backward = self.forward_steps(rank), self.backward_steps(rank)
        ring = self.world_size - 1
        kv_fwd, kv_bwd = sent(forward, "kv_to"), sent(backward, "kv_to")
        dkv = sent(backward, "dkv_to")  # sums of these sources' blocks go back
        return TransferCounts(
            forward_kv=len(kv_fwd), backward_kv=len(kv_bwd), backward_dkv=len(dkv),
            ring_forward=ring, ring_backward=2 * ring,
            forward_kv_rows=sum(self.row_count(rank, r) for r in kv_fwd),
            backward_kv_rows=sum(self.row_count(rank, r) for r in kv_bwd),
            backward_dkv_rows=sum(self.row_count(s, rank) for s in dkv),
            block_rows=self.block_rows,
        )


# The own block moves out of its classic place only when the timeline model's call time falls
# by more than this fraction.
FILL_GAIN = 0.02


def own_schedules(plan: TransferPlan, phase: str) -> tuple[tuple[int, ...], ...] | None:
    """Where every rank computes its own block in ``phase``, or ``None`` for the classic place.

    A rank's own block needs no message, so it can be computed at any step. A step's
    messages are posted before its compute and waited for after it, and a message completes
    only once both its ranks have posted it; so a rank whose peers are still computing
    waits, and a layout balanced in total but not per step (``whole``) loses that time. The
    own block fills those waits: a timeline model of the call (every rank's steps, compute
    time proportional to visible pairs, transfers free, a round completing when its last
    rank posts) gives each step the own-block pairs that fit in the rank's wait there. The
    forward still starts with a share of the own block (a typical received block's work),
    so the first transfer has something to hide behind, and the backward keeps that much
    for its last step, behind which the last dK/dV sum travels home. Kept only when the
    model's call time falls by more than :data:`FILL_GAIN`; otherwise (every step balanced,
    as with ``balanced`` or zigzag) ``None``. Needs ``plan.work``."""
    if not plan.work:
        return None
    return _placed(plan, phase)[1]


def modelled_time(work: Sequence[Sequence[int]]) -> float:
    """The timeline model's time of one ring call over a layout with this block-work matrix
    (``[reader][source]`` visible pairs; see :func:`own_schedules`): the forward plus 2.5
    times the backward, in visible pairs, each with the own block where the plan would put
    it. For comparing rank numberings of one layout (``whole``)."""
    world = len(work)
    reads = tuple(tuple(work[r][s] > 0 for s in range(world)) for r in range(world))
    plan = TransferPlan(world_size=world, reads=reads, rounds=transfer_rounds(reads),
                        work=tuple(map(tuple, work)))
    return _placed(plan, "forward")[0] + 2.5 * _placed(plan, "backward")[0]


def _placed(plan: TransferPlan,
            phase: str) -> tuple[float, tuple[tuple[int, ...], ...] | None]:
    """The model's call time with the own block where the plan puts it, and the schedules
    (``None``: the classic place; see :func:`own_schedules`)."""
    classic, _ = _timeline(plan, phase, fill=False)
    filled, schedules = _timeline(plan, phase, fill=True)
    if filled >= classic * (1 - FILL_GAIN):
        return classic, None
    return filled, schedules


def _timeline(plan: TransferPlan, phase: str,
              fill: bool) -> tuple[float, tuple[tuple[int, ...], ...]]:
    """The model's call time (the last rank's finish, in visible pairs) and, with ``fill``,
    every rank's cumulative own-block pairs per step (see :func:`own_schedules`)."""
    world, work = plan.world_size, plan.work
    steps = [plan.forward_steps(r) if phase == "forward" else plan.backward_steps(r)
             for r in range(world)]
    own = [work[r][r] for r in range(world)]
    typical = []
    for r in range(world):
        read = [work[r][s] for s in range(world) if s != r and work[r][s]]
        typical.append(min(own[r], sum(read) // len(read) if read else own[r]))
    # Filling: the forward computes ``typical`` at its first step, the backward keeps it for
    # its last; the rest fills waits.
    budget = [own[r] - typical[r] if fill else 0 for r in range(world)]
    amounts = [[0] * len(steps[r]) for r in range(world)]
    clock = [0.0] * world
    position = [0] * world
    at_round = [{step.round: i for i, step in enumerate(steps[r]) if step.round is not None}
                for r in range(world)]

    def compute(r: int, i: int) -> int:
        block = steps[r][i].block
        if block is None:
            return 0
        if block != r:
            return work[r][block]
        if not fill:
            return own[r]
        return typical[r] if phase == "forward" else 0

    def advance(r: int, stop: int) -> None:  # steps with nothing to wait for
        while position[r] < stop:
            clock[r] += compute(r, position[r])
            position[r] += 1

    rounds = sorted({k for table in at_round for k in table}, reverse=phase == "backward")
    for k in rounds:
        members = [r for r in range(world) if k in at_round[r]]
        for r in members:
            advance(r, at_round[r][k])
        posted = {r: clock[r] for r in members}
        for r in members:
            step = steps[r][position[r]]
            exchange = step.exchange
            peers = {exchange.kv_from, exchange.kv_to, exchange.dkv_from, exchange.dkv_to}
            complete = max([posted[p] for p in peers if p is not None] + [posted[r]])
            ready = posted[r] + compute(r, position[r])
            filled = min(max(0.0, complete - ready), budget[r])
            budget[r] -= filled
            amounts[r][position[r]] += round(filled)
            clock[r] = max(ready + filled, complete)
            position[r] += 1
    for r in range(world):
        advance(r, len(steps[r]))
        if fill and steps[r]:
            first = 0 if phase == "forward" else len(steps[r]) - 1
            amounts[r][first] += typical[r]
            amounts[r][-1] += own[r] - sum(amounts[r])  # what no wait took: at the end
            clock[r] += budget[r] + (typical[r] if phase == "backward" else 0)
    schedules = tuple(tuple(itertools.accumulate(row)) for row in amounts)
    return max(clock, default=0.0), schedules


def transfer_rounds(reads: Sequence[Sequence[bool]]) -> tuple[tuple[Pair, ...], ...]:
    """Every ``(source, reader)`` pair with ``reads[reader][source]`` (source != reader),
    grouped into rounds in which each rank is at most one pair's source and at most one
    pair's reader. Each round is a maximum matching of what is left, found by augmenting
    paths from the readers with the most blocks still to come; a reader tries its sources
    nearest first in ring distance ``(reader - source) mod N``, so when every block is read
    round t is exactly ring distance t."""
    world = len(reads)
    by_distance = {r: [(r - d) % world for d in range(1, world)] for r in range(world)}
    waiting = {r: [s for s in by_distance[r] if reads[r][s]] for r in range(world)}
    rounds = []
    while any(waiting.values()):
        source_of: dict[int, int] = {}
        reader_of: dict[int, int] = {}
        order = sorted((r for r in range(world) if waiting[r]), key=lambda r: (-len(waiting[r]), r))
        for reader in order:
            _augment(reader, waiting, source_of, reader_of, set())
        rounds.append(tuple(sorted((s, r) for r, s in source_of.items())))
        for reader, source in source_of.items():
            waiting[reader].remove(source)
    return tuple(rounds)


def _augment(reader: int, waiting: dict[int, list[int]], source_of: dict[int, int],
             reader_of: dict[int, int], visited: set[int]) -> bool:
    """Match ``reader`` to a source, moving earlier readers to other sources if need be
    (an augmenting path); False when no path exists."""
    for source in waiting[reader]:
        if source in visited:
            continue
        visited.add(source)
        holder = reader_of.get(source)
        if holder is None or _augment(holder, waiting, source_of, reader_of, visited):
            source_of[reader] = source
            reader_of[source] = reader
            return True
    return False
