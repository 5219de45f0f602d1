"""Where each rank of a job runs: a rank -> (node, slot) plan from a snapshot of live nodes.

    plan = plan_placement(nodes, cp=4, dp_options=[4, 2, 1], kv_block_bytes=kv_bytes)
    print(plan.describe())                        # dp x cp, each ring's nodes, hops, transfer
    bundles = plan.slots_by_node()                # what the placement group must reserve
    ...                                           # start one actor per rank on plan.node_of(rank)
    verify_placement(plan, actual_nodes)          # fail loudly if Ray put an actor elsewhere

Ranks follow the trainer's mesh: global rank = dp_index * cp + cp_rank, so ring ``i`` is
ranks ``[i*cp, (i+1)*cp)``. A ring step sends every rank's KV block to the next rank, so a
ring runs at the speed of its slowest link. The plan therefore, in priority order:

1. takes the largest dp in ``dp_options`` that the live slots can hold (``dp * cp`` slots;
   a ring may span nodes, so that is also sufficient);
2. minimises the total number of cross-node hops: a ring that fits in a node goes whole
   (0 hops, best fit); otherwise it spans as few nodes as it can with its ranks contiguous
   per node, so spanning ``k`` nodes crosses ``k`` node boundaries, the least possible;
3. spreads the rings (DP replicas) over distinct values of the ``failure_domain`` label
   where that costs no hop;
4. is deterministic: the same snapshot (in any order) gives the same plan, ties by node id.

With Ulysses × ring context parallelism (``ulysses`` > 1) every group of ``ulysses``
consecutive ranks of a ring stays on one node, and the same plan is made for whole groups.

How step 2 is exact. Using every whole-ring slot first is optimal (checked against a brute
force over every cluster of up to 5 nodes x 6 slots, every cp and dp; ``tests/test_placement.py``
pins every cluster of up to 4 nodes x 4 slots). What is left on each node is then under ``cp``
slots, and the remaining rings are laid along *chains* of those nodes, each ring continuing
where the last one ended. A memoised search over (nodes left per free-slot count, rings left,
ring in progress) finds the cheapest chains exactly. That search is NP-hard in general (it
contains 3-partition), so past a state budget (reached by clusters with many distinct free-slot
counts, e.g. 30 nodes of 1 to 8 free slots each, after about 0.5 s) it gives way to a greedy
chain: largest node first, each ring closed by the smallest node that completes it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# The exact chain search stops and falls back to the greedy chain past this many memoised
# states (about 0.5 s of Python); clusters with few distinct free-slot counts, such as nodes
# of 8 accelerators, stay far below it. The greedy chain was 1 hop above the minimum in 24 of
# 3458 cases of up to 4 nodes x 5 slots.
SPLIT_SEARCH_STATE_BUDGET = 50_000
# Recursion depth of the exact search is the number of partly free nodes; beyond this many
# the greedy chain is used directly.
_SPLIT_SEARCH_MAX_NODES = 256
# How many nodes an error message lists before it summarises the rest.
_NODES_LISTED_IN_ERRORS = 8


class PlacementError(ValueError):
    """No feasible plan on the live nodes, or actors that do not run where the plan put them.

    The message says what is missing, e.g. ``placement: cp=4 x dp>=2 needs 8 worker slots on
    live nodes; they have 6 (node-a: 2, node-b: 4)``.
    """


@dataclass(frozen=True, kw_only=True)
class NodeSnapshot:
    """One live node as the controller sees it when it plans."""

    node_id: str
    slots: int  # worker slots (accelerators) usable by this job; 0 means the node is skipped
    labels: Mapping[str, str] = field(default_factory=dict)  # e.g. {"zone": "us-a", "rack": "r1"}

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("NodeSnapshot.node_id must be a non-empty string")
        if self.slots < 0:
            raise ValueError(
                f"NodeSnapshot.slots must be >= 0; got {self.slots} for node {self.node_id!r}"
            )


@dataclass(frozen=True, kw_only=True)
class LinkBandwidths:
    """Link speeds in Gb/s (gigabits per second, 1e9 bits/s) used to predict ring-step time."""

    # NVIDIA's H100 SXM datasheet: "NVLink: 900 GB/s" per GPU (NVLink 4, 18 links). That is
    # the aggregate of both directions, so one direction of a ring gets at most half of it;
    # the figure is an upper bound for comparing placements, not a promise.
    intra_node_gbps: float = 900 * 8
    # One 400 Gb/s NIC per GPU, as in a DGX H100 (8 x ConnectX-7 NDR 400 Gb/s InfiniBand).
    inter_node_gbps: float = 400
    # Per node-pair override (frozenset({"node-a", "node-b"}) -> Gb/s), e.g. across zones.
    between: Mapping[frozenset[str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, gbps in (
            ("intra_node_gbps", self.intra_node_gbps),
            ("inter_node_gbps", self.inter_node_gbps),
        ):
            if not gbps > 0:
                raise ValueError(f"LinkBandwidths.{name} must be > 0 Gb/s; got {gbps}")
        for pair, gbps in self.between.items():
            if not isinstance(pair, frozenset) or len(pair) != 2:
                raise ValueError(
                    f"LinkBandwidths.between keys must be frozensets of two node ids; got {pair!r}"
                )
            if not gbps > 0:
                raise ValueError(
                    f"LinkBandwidths.between[{sorted(pair)}] must be > 0 Gb/s; got {gbps}"
                )

    def gbps(self, node_a: str, node_b: str) -> float:
        """The speed of the link from a rank on ``node_a`` to one on ``node_b``."""
        if node_a == node_b:
            return self.intra_node_gbps
        return self.between.get(frozenset((node_a, node_b)), self.inter_node_gbps)


@dataclass(frozen=True, kw_only=True)
class RankPlacement:
    rank: int
    node_id: str
    slot: int  # 0..(slots used on that node - 1), in rank order on the node


@dataclass(frozen=True, kw_only=True)
class RingCost:
    """What one ring (one DP replica) costs per ring step where it was placed."""

    ring: int  # dp index
    ranks: tuple[int, ...]  # the ring's global ranks, cp_rank order
    nodes: tuple[str, ...]  # the distinct nodes it spans, in ring order
    cross_node_hops: int  # 0 on one node, k when it spans k >= 2 nodes (the ring closes)
    # kv_block_bytes / the slowest link's bytes/s; 0.0 for cp=1 (no ring step transfers);
    # None when the planner was not given kv_block_bytes.
    step_transfer_seconds: float | None


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """The placement of a dp x cp job: ``ranks[r]`` says where global rank ``r`` runs."""

    dp: int
    cp: int
    ranks: tuple[RankPlacement, ...]  # index == global rank
    rings: tuple[RingCost, ...]  # index == dp index

    def __post_init__(self) -> None:
        if len(self.ranks) != self.dp * self.cp or len(self.rings) != self.dp:
            raise ValueError(
                f"PlacementPlan: dp={self.dp} x cp={self.cp} needs {self.dp * self.cp} ranks "
                f"and {self.dp} rings; got {len(self.ranks)} and {len(self.rings)}"
            )
        if any(placed.rank != rank for rank, placed in enumerate(self.ranks)):
            raise ValueError("PlacementPlan.ranks must be in global rank order")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def cross_node_hops(self) -> int:
        """Node boundaries crossed per ring step, summed over the rings."""
        return sum(ring.cross_node_hops for ring in self.rings)

    def node_of(self, rank: int) -> str:
        return self.ranks[rank].node_id

    def slots_by_node(self) -> dict[str, int]:
        """Slots the plan uses on each node (nodes in first-rank order)."""
        return dict(Counter(placed.node_id for placed in self.ranks))

    def describe(self) -> str:
        """A few human lines: dp x cp, each ring's nodes, hops and predicted step transfer."""
        used = self.slots_by_node()
        lines = [
            f"placement: dp={self.dp} x cp={self.cp} = {self.world_size} ranks on "
            f"{len(used)} node(s), {self.cross_node_hops} cross-node hop(s) per ring step"
        ]
        for ring in self.rings:
            first, last = ring.ranks[0], ring.ranks[-1]
            ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
            line = f"  ring {ring.ring}: {ranks} on {' -> '.join(ring.nodes)}"
            line += f", {ring.cross_node_hops} cross-node hop(s)"
            if ring.step_transfer_seconds is not None:
                line += f", {ring.step_transfer_seconds * 1e3:.3g} ms KV transfer per ring step"
            lines.append(line)
        return "\n".join(lines)


def plan_placement(
    nodes: Sequence[NodeSnapshot],
    *,
    cp: int,
    dp_options: Sequence[int],
    failure_domain: str | None = "zone",
    bandwidths: LinkBandwidths | None = None,
    kv_block_bytes: int | None = None,
    ulysses: int = 1,
) -> PlacementPlan:
    """Place ``dp`` rings of ``cp`` ranks on ``nodes``, dp the largest feasible of ``dp_options``.

    ``failure_domain`` names the node label whose values the rings spread over (None: no
    spreading). ``kv_block_bytes`` (the bytes one rank sends per ring step) turns on the
    predicted transfer time per ring; ``bandwidths`` defaults to ``LinkBandwidths()``.
    ``ulysses`` > 1: each run of ``ulysses`` consecutive ranks of a ring (a Ulysses group,
    whose all-to-all wants a node's fast links) sits on one node; see :func:`_plan_groups`.
    Raises ValueError for malformed arguments and PlacementError when no dp option fits.
    """
    if ulysses > 1:
        return _plan_groups(nodes, cp=cp, dp_options=dp_options, failure_domain=failure_domain,
                            bandwidths=bandwidths, kv_block_bytes=kv_block_bytes, ulysses=ulysses)
    _check_arguments(nodes, cp=cp, dp_options=dp_options, kv_block_bytes=kv_block_bytes)
    live = sorted((node for node in nodes if node.slots > 0), key=lambda node: node.node_id)
    dp = _largest_feasible_dp(nodes, live, cp=cp, dp_options=dp_options)
    domain_of = {
        node.node_id: node.labels.get(failure_domain) if failure_domain else None for node in live
    }
    rings = _assign_rings({node.node_id: node.slots for node in live}, cp, dp, domain_of)
    # Rings on the same nodes get neighbouring dp indices; the sort also makes the order
    # independent of how the search happened to find them.
    rings.sort(key=lambda pieces: [node_id for node_id, _ in pieces])
    return _build_plan(rings, cp=cp, bandwidths=bandwidths or LinkBandwidths(), kv=kv_block_bytes)


def _plan_groups(
    nodes: Sequence[NodeSnapshot], *, cp: int, dp_options: Sequence[int],
    failure_domain: str | None, bandwidths: LinkBandwidths | None, kv_block_bytes: int | None,
    ulysses: int,
) -> PlacementPlan:
    """Plan with Ulysses groups kept whole: a group of ``ulysses`` ranks is one unit, a node
    offers ``slots // ulysses`` units, a ring is ``cp // ulysses`` units, and the plan for
    units (exact as above) is spread back to ranks, each unit's ranks on its node. A ring of
    units over ``k`` nodes still crosses ``k`` node boundaries per ring step: the ring's K/V
    blocks travel between units (each rank to the same Ulysses index of the next unit)."""
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1:
        raise ValueError(f"ulysses: must be an integer >= 1; got {ulysses!r}")
    if cp % ulysses:
        raise ValueError(f"ulysses: cp={cp} is not a multiple of ulysses={ulysses} (a ring "
                         f"is cp / ulysses Ulysses groups)")
    units = [NodeSnapshot(node_id=node.node_id, slots=node.slots // ulysses, labels=node.labels)
             for node in nodes]
    try:
        plan = plan_placement(units, cp=cp // ulysses, dp_options=dp_options,
                              failure_domain=failure_domain, bandwidths=bandwidths,
                              kv_block_bytes=kv_block_bytes)
    except PlacementError as exc:
        raise PlacementError(f"{exc} (counting whole Ulysses groups of {ulysses} ranks, each "
                             f"on one node: a node's slots // {ulysses})") from None
    ranks = tuple(
        RankPlacement(rank=unit.rank * ulysses + u, node_id=unit.node_id,
                      slot=unit.slot * ulysses + u)
        for unit in plan.ranks for u in range(ulysses)
    )
    rings = tuple(
        RingCost(ring=ring.ring, ranks=tuple(range(ring.ring * cp, (ring.ring + 1) * cp)),
                 nodes=ring.nodes, cross_node_hops=ring.cross_node_hops,
                 step_transfer_seconds=ring.step_transfer_seconds)
        for ring in plan.rings
    )
    return PlacementPlan(dp=plan.dp, cp=cp, ranks=ranks, rings=rings)


def verify_placement(plan: PlacementPlan, actual_nodes: Sequence[str]) -> None:
    """Check that rank ``r``'s actor really runs on ``plan.node_of(r)`` (``actual_nodes[r]``).

    Raises PlacementError naming every rank that runs elsewhere, e.g. ``rank 3 planned on
    node-b, runs on node-a``, or when the number of reported actors is not the world size.
    """
    if len(actual_nodes) != plan.world_size:
        raise PlacementError(
            f"placement check: the plan has {plan.world_size} ranks but "
            f"{len(actual_nodes)} actors reported their node"
        )
    wrong = [
        f"rank {rank} planned on {placed.node_id}, runs on {actual}"
        for rank, (placed, actual) in enumerate(zip(plan.ranks, actual_nodes, strict=True))
        if placed.node_id != actual
    ]
    if wrong:
        raise PlacementError(
            f"placement check: {len(wrong)} of {plan.world_size} ranks run off-plan: "
            + "; ".join(wrong)
        )


# ---- arguments and feasibility ----------------------------------------------------------


def _check_arguments(
    nodes: Sequence[NodeSnapshot], *, cp: int, dp_options: Sequence[int], kv_block_bytes: int | None
) -> None:
    if cp < 1:
        raise ValueError(f"placement: cp must be >= 1; got {cp}")
    if not dp_options:
        raise ValueError("placement: dp_options is empty; give at least one dp degree >= 1")
    if any(dp < 1 for dp in dp_options):
        raise ValueError(f"placement: every dp option must be >= 1; got {list(dp_options)}")
    if kv_block_bytes is not None and kv_block_bytes <= 0:
        raise ValueError(f"placement: kv_block_bytes must be > 0 when given; got {kv_block_bytes}")
    repeated = sorted(node_id for node_id, n in Counter(n.node_id for n in nodes).items() if n > 1)
    if repeated:
        raise ValueError(f"placement: duplicate node ids in the snapshot: {', '.join(repeated)}")


def _largest_feasible_dp(
    nodes: Sequence[NodeSnapshot], live: list[NodeSnapshot], *, cp: int, dp_options: Sequence[int]
) -> int:
    """The largest dp option whose dp*cp ranks fit in the live slots, else PlacementError."""
    total = sum(node.slots for node in live)
    feasible = [dp for dp in dp_options if dp * cp <= total]
    if feasible:
        return max(feasible)
    if not live:
        have = "there are none with free slots"
    else:
        listed = ", ".join(
            f"{node.node_id}: {node.slots}" for node in live[:_NODES_LISTED_IN_ERRORS]
        )
        if len(live) > _NODES_LISTED_IN_ERRORS:
            listed += f", and {len(live) - _NODES_LISTED_IN_ERRORS} more"
        have = f"they have {total} ({listed})"
    idle = sorted(node.node_id for node in nodes if node.slots == 0)
    if idle:
        have += f"; ignored with 0 slots: {', '.join(idle)}"
    if cp > total:
        raise PlacementError(
            f"placement: one ring of cp={cp} needs {cp} worker slots on live nodes, more than "
            f"the whole cluster; {have}"
        )
    dp = min(dp_options)
    raise PlacementError(
        f"placement: cp={cp} x dp>={dp} needs {cp * dp} worker slots on live nodes; {have}"
    )


# ---- which node slots each ring gets -------------------------------------------------------

# A ring as (node_id, ranks on that node) pieces in cp_rank order.
_Ring = tuple[tuple[str, int], ...]


def _assign_rings(
    free: dict[str, int], cp: int, dp: int, domain_of: Mapping[str, str | None]
) -> list[_Ring]:
    """Whole rings first (as many as fit, spread over domains, best fit), then chains."""
    free = dict(free)
    rings_per_domain: Counter[str | None] = Counter()
    whole_capacity = sum(slots // cp for slots in free.values())
    rings: list[_Ring] = []
    for _ in range(min(dp, whole_capacity)):
        node_id = min(
            (node_id for node_id, slots in free.items() if slots >= cp),
            # Least-used failure domain first; then best fit (least free), then id.
            key=lambda node_id: (rings_per_domain[domain_of[node_id]], free[node_id], node_id),
        )
        free[node_id] -= cp
        rings_per_domain[domain_of[node_id]] += 1
        rings.append(((node_id, cp),))
    split = dp - len(rings)
    if split:
        # Every node now has fewer than cp free slots (all whole-ring room was used).
        partly_free = {node_id: slots for node_id, slots in free.items() if slots > 0}
        steps = _split_ring_steps(partly_free, cp, split)
        rings += _realise_chains(steps, partly_free, cp, domain_of, rings_per_domain)
    return rings


@dataclass(frozen=True)
class _ChainStep:
    """Take one more node into the chain: one with ``free_slots`` free slots.

    Its slots continue the ring in progress (or start one). When they complete a ring with
    slots to spare, ``carry_on`` says whether those start the next ring (one more hop) or
    stay unused (the chain ends there).
    """

    free_slots: int
    carry_on: bool = False


def _chain_moves(
    free_slots: int, partial: int, rings_left: int, cp: int
) -> list[tuple[_ChainStep, int, int, int]]:
    """Each way to take a node with ``free_slots`` (< cp) into the chain, as
    (step, hops it adds, rings left after, ranks of the ring in progress after)."""
    if partial == 0:
        return [(_ChainStep(free_slots), 1, rings_left, free_slots)]
    need = cp - partial
    if free_slots < need:
        return [(_ChainStep(free_slots), 1, rings_left, partial + free_slots)]
    moves = [(_ChainStep(free_slots), 1, rings_left - 1, 0)]
    if free_slots > need and rings_left > 1:
        moves.append((_ChainStep(free_slots, carry_on=True), 2, rings_left - 1, free_slots - need))
    return moves


class _SearchBudgetExceeded(Exception):
    pass


def _split_ring_steps(partly_free: Mapping[str, int], cp: int, rings: int) -> list[_ChainStep]:
    """The cheapest chain steps placing ``rings`` rings on nodes with < cp free slots each.

    Exact (memoised search) within SPLIT_SEARCH_STATE_BUDGET states, else the greedy chain.
    """
    if len(partly_free) <= _SPLIT_SEARCH_MAX_NODES:
        try:
            return _exact_split_steps(partly_free, cp, rings, SPLIT_SEARCH_STATE_BUDGET)
        except _SearchBudgetExceeded:
            pass
    return _greedy_split_steps(partly_free, cp, rings)


def _exact_split_steps(
    partly_free: Mapping[str, int], cp: int, rings: int, budget: int
) -> list[_ChainStep]:
    counted = sorted(Counter(partly_free.values()).items(), reverse=True)
    values = tuple(value for value, _ in counted)
    # state: (nodes left per value, rings left, ranks of the ring in progress)
    State = tuple[tuple[int, ...], int, int]
    memo: dict[State, tuple[float, _ChainStep | None, State | None]] = {}

    def cheapest(state: State) -> float:
        counts, rings_left, partial = state
        if rings_left == 0:
            return 0
        if state in memo:
            return memo[state][0]
        if len(memo) >= budget:
            raise _SearchBudgetExceeded
        best: tuple[float, _ChainStep | None, State | None] = (math.inf, None, None)
        if sum(v * n for v, n in zip(values, counts, strict=True)) + partial >= rings_left * cp:
            # Every ring still to close needs >= 2 nodes, one of them new for the ring in
            # progress; reaching this bound ends the search early.
            bound = 2 * rings_left - (1 if partial else 0)
            for index, value in enumerate(values):
                if not counts[index]:
                    continue
                rest = counts[:index] + (counts[index] - 1,) + counts[index + 1 :]
                for step, hops, rings_after, partial_after in _chain_moves(
                    value, partial, rings_left, cp
                ):
                    nxt = (rest, rings_after, partial_after)
                    cost = hops + cheapest(nxt)
                    if cost < best[0]:
                        best = (cost, step, nxt)
                if best[0] <= bound:
                    break
        memo[state] = best
        return best[0]

    state: State = (tuple(n for _, n in counted), rings, 0)
    if math.isinf(cheapest(state)):  # cannot happen: the caller checked the slots suffice
        raise PlacementError(f"placement: no chain places {rings} rings of cp={cp}")
    steps = []
    while state[1]:
        _, step, nxt = memo[state]
        assert step is not None and nxt is not None
        steps.append(step)
        state = nxt
    return steps


def _greedy_split_steps(partly_free: Mapping[str, int], cp: int, rings: int) -> list[_ChainStep]:
    """Largest node first; a ring in progress closes on the smallest node that completes it,
    which carries its spare slots on into the next ring."""
    left = sorted(partly_free.values())
    steps: list[_ChainStep] = []
    partial, rings_left = 0, rings
    while rings_left:
        need = cp - partial
        closing = [value for value in left if value >= need] if partial else []
        value = min(closing) if closing else max(left)
        left.remove(value)
        if partial and value >= need:
            rings_left -= 1
            spare = value - need
            carry_on = bool(spare) and rings_left > 0
            steps.append(_ChainStep(value, carry_on=carry_on))
            partial = spare if carry_on else 0
        else:
            steps.append(_ChainStep(value))
            partial += value
    return steps


def _realise_chains(
    steps: list[_ChainStep],
    partly_free: Mapping[str, int],
    cp: int,
    domain_of: Mapping[str, str | None],
    rings_per_domain: Counter[str | None],
) -> list[_Ring]:
    """Turn chain steps (which name free-slot counts) into rings on named nodes.

    Nodes with equal free slots are interchangeable for hops, so the choice among them keeps
    a ring inside its first node's failure domain (cheaper links), starts a ring in the
    least-used domain, and breaks ties by node id.
    """
    by_free: dict[int, list[str]] = defaultdict(list)
    for node_id in sorted(partly_free):
        by_free[partly_free[node_id]].append(node_id)
    rings: list[_Ring] = []
    current: list[tuple[str, int]] = []
    partial = 0
    for step in steps:
        home = domain_of[current[0][0]] if current else None
        node_id = min(
            by_free[step.free_slots],
            key=lambda n: (
                bool(current) and domain_of[n] != home,
                rings_per_domain[domain_of[n]],
                n,
            ),
        )
        by_free[step.free_slots].remove(node_id)
        if not current:
            rings_per_domain[domain_of[node_id]] += 1
        taken = min(step.free_slots, cp - partial)
        current.append((node_id, taken))
        partial += taken
        if partial == cp:
            rings.append(tuple(current))
            current, partial = [], 0
            spare = step.free_slots - taken
            if step.carry_on and spare:
                rings_per_domain[domain_of[node_id]] += 1
                current, partial = [(node_id, spare)], spare
    assert not current, "chain steps must end on a closed ring"
    return rings


# ---- the plan and its costs ----------------------------------------------------------------


def _build_plan(
    rings: list[_Ring], *, cp: int, bandwidths: LinkBandwidths, kv: int | None
) -> PlacementPlan:
    slots_used: Counter[str] = Counter()
    ranks: list[RankPlacement] = []
    costs: list[RingCost] = []
    for ring_index, pieces in enumerate(rings):
        ring_nodes = [node_id for node_id, count in pieces for _ in range(count)]
        first_rank = ring_index * cp
        for offset, node_id in enumerate(ring_nodes):
            ranks.append(
                RankPlacement(rank=first_rank + offset, node_id=node_id, slot=slots_used[node_id])
            )
            slots_used[node_id] += 1
        costs.append(_ring_cost(ring_index, first_rank, ring_nodes, bandwidths, kv))
    return PlacementPlan(dp=len(rings), cp=cp, ranks=tuple(ranks), rings=tuple(costs))


def _ring_cost(
    ring_index: int,
    first_rank: int,
    ring_nodes: list[str],
    bandwidths: LinkBandwidths,
    kv: int | None,
) -> RingCost:
    """Hops and predicted transfer time of one ring, from where its ranks sit."""
    # Each rank sends to the next, the last to the first: cp links (none for cp=1).
    links = list(zip(ring_nodes, ring_nodes[1:] + ring_nodes[:1], strict=True))
    if len(ring_nodes) == 1:
        links = []
    transfer: float | None = None
    if kv is not None:
        slowest_gbps = min((bandwidths.gbps(a, b) for a, b in links), default=math.inf)
        transfer = kv / (slowest_gbps * 1e9 / 8)  # Gb/s -> bytes/s
    return RingCost(
        ring=ring_index,
        ranks=tuple(range(first_rank, first_rank + len(ring_nodes))),
        nodes=tuple(dict.fromkeys(ring_nodes)),
        cross_node_hops=sum(a != b for a, b in links),
        step_transfer_seconds=transfer,
    )
