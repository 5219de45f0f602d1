"""One layer's ring under a mask, timed from the step plan the ring really runs.

The overlap rule (:func:`~.fit.overlap_check`) assumes one causal document and a plain ring:
N - 1 steps, each sending a whole K/V block while half a block pair is computed. Under packed
documents or a sliding window the ring does something else: each block goes only to the
ranks that read it, only the rows they read travel, and the compute per step is the visible
query-key pairs of that block pair (:mod:`ringray.attention.transfers`,
:func:`~ringray.attention.layouts.block_work`). :func:`masked_ring` walks every rank's planned
steps with the accelerator's peak and the ring link's rate::

    forward step   compute  = pairs(r, block) x 4 e h / F         (QK^T and PV, h query heads)
                   transfer = max(rows sent, rows received) x 2 k e a / B   (full duplex)
                   time     = max(compute, transfer)
    backward step  compute  = 2.5 x the forward's pairs
                   transfer = K/V rows x 2 k e a + dK/dV rows x 2 k e 4, the larger way / B

so a layer takes, on its slowest rank, the sum of its step times, and what the compute does
not cover is exposed. The plain ring (every block relayed whole, N - 1 steps) is the same
walk with every block read whole (:func:`plain_ring`). These are projections at peak compute
(the hardest case to hide a transfer in), not measurements.

    ring = masked_ring(make_layout("whole", 8, 65536, documents=docs), docs, None, spec)
    ring.seconds, ring.exposed_seconds, ring.bytes_fraction
"""

from __future__ import annotations

from dataclasses import dataclass

from ringray.attention.documents import Documents, check_documents
from ringray.attention.layouts import Layout, block_work
from ringray.attention.transfer_plan import TransferPlan
from ringray.attention.transfers import plan_transfers


@dataclass(frozen=True, kw_only=True)
class RingShape:
    """What one rank's ring call moves and computes per token: heads (after any Ulysses
    split), head size, rows of the batch, element sizes, and the device's rates."""

    q_heads: float
    kv_heads: float
    head_dim: int
    batch: int = 1
    kv_bytes: int = 2  # per K/V element (bf16)
    peak_flops: float
    link_bytes_per_second: float

    @property
    def kv_row_bytes(self) -> float:
        """K and V of one token (one row of a block), all kv heads, all batch rows."""
        return self.batch * 2 * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def dkv_row_bytes(self) -> float:
        return self.batch * 2 * self.kv_heads * self.head_dim * 4  # float32 dK/dV sums

    def pair_seconds(self) -> float:
        """One visible query-key pair, forward: QK^T and PV over every query head."""
        return self.batch * 4 * self.head_dim * self.q_heads / self.peak_flops


@dataclass(frozen=True, kw_only=True)
class MaskedRing:
    """One layer's ring call (forward and backward) on its slowest rank."""

    seconds: float  # the slowest rank's steps, compute and exposed transfer
    compute_seconds: float  # that rank's compute alone
    exposed_seconds: float  # seconds - compute_seconds
    bytes_sent: float  # all ranks, one call, forward and backward
    plain_bytes: float  # what the plain ring sends: N - 1 whole blocks each way per rank
    useful_flops: float  # all ranks: visible pairs x (1 + 2.5) x 4 e h

    @property
    def bytes_fraction(self) -> float:
        return self.bytes_sent / self.plain_bytes if self.plain_bytes else 0.0

    def flops_per_device(self, world: int) -> float:
        """Useful FLOP/s per device over the call: what the mask leaves to compute, divided
        by the slowest rank's time."""
        return self.useful_flops / world / self.seconds if self.seconds else 0.0


def _exchange_rows(plan: TransferPlan, rank: int, exchange, backward: bool
                   ) -> tuple[float, float]:
    """(K/V rows, dK/dV rows) that cross this rank's link in one exchange, the busier way
    (a link carries both directions at once)."""
    rows = plan.row_count
    kv_out = rows(rank, exchange.kv_to) if exchange.kv_to is not None else 0
    kv_in = rows(exchange.kv_from, rank) if exchange.kv_from is not None else 0
    dkv_out = dkv_in = 0
    if backward:
        dkv_out = rows(exchange.dkv_to, rank) if exchange.dkv_to is not None else 0
        dkv_in = rows(rank, exchange.dkv_from) if exchange.dkv_from is not None else 0
    return (kv_out, dkv_out) if kv_out + dkv_out >= kv_in + dkv_in else (kv_in, dkv_in)


def masked_ring(layout: Layout, documents: Documents | list[int] | None, window: int | None,
                shape: RingShape) -> MaskedRing:
    """The step-plan timing of one ring call over ``layout`` (causal) under ``documents``
    and ``window`` (see the module docstring)."""
    docs = check_documents(documents, layout.seq_len) if documents is not None else None
    plan = plan_transfers(layout, True, docs, window)
    work = block_work(layout, docs, causal=True, window=window)
    pair = shape.pair_seconds()
    worst = None
    for rank in range(layout.world_size):
        total = compute = exposed = 0.0
        for phase, factor in (("forward", 1.0), ("backward", 2.5)):
            steps = plan.forward_steps(rank) if phase == "forward" else plan.backward_steps(rank)
            schedule = plan.own_schedule(rank, phase)  # the own block spread over the steps
            for index, step in enumerate(steps):
                pairs = (work[rank][step.block] if step.block is not None and
                         (schedule is None or step.block != rank) else 0)
                if schedule is not None:
                    pairs += schedule[index] - (schedule[index - 1] if index else 0)
                step_compute = pairs * pair * factor
                transfer = 0.0
                if step.exchange is not None:
                    kv, dkv = _exchange_rows(plan, rank, step.exchange, phase == "backward")
                    transfer = (kv * shape.kv_row_bytes + dkv * shape.dkv_row_bytes) \
                        / shape.link_bytes_per_second
                total += max(step_compute, transfer)
                compute += step_compute
                exposed += max(0.0, transfer - step_compute)
        if worst is None or total > worst[0]:
            worst = (total, compute, exposed)
    sent = sum(plan.counts(r).bytes_sent(shape.kv_row_bytes, shape.dkv_row_bytes)
               for r in range(layout.world_size))
    plain = layout.world_size * plan.counts(0).ring_bytes(shape.kv_row_bytes,
                                                         shape.dkv_row_bytes)
    pairs = sum(map(sum, work))
    return MaskedRing(seconds=worst[0], compute_seconds=worst[1], exposed_seconds=worst[2],
                      bytes_sent=sent, plain_bytes=plain,
                      useful_flops=pairs * 3.5 * pair * shape.peak_flops)


def plain_ring(layout: Layout, documents: Documents | list[int] | None, window: int | None,
               shape: RingShape) -> MaskedRing:
    """The plain ring over the same layout and mask: N - 1 steps a phase, each relaying a
    whole K/V block (and, backward, a whole float32 dK/dV sum) while the block pair in hand
    is computed (its visible pairs only: empty tiles are skipped either way)."""
    docs = check_documents(documents, layout.seq_len) if documents is not None else None
    work = block_work(layout, docs, causal=True, window=window)
    world, block = layout.world_size, layout.local_len
    pair = shape.pair_seconds()
    forward_transfer = block * shape.kv_row_bytes / shape.link_bytes_per_second
    backward_transfer = block * (shape.kv_row_bytes + shape.dkv_row_bytes) \
        / shape.link_bytes_per_second
    worst = None
    for rank in range(world):
        total = compute = exposed = 0.0
        for step in range(world):
            pairs = work[rank][(rank - step) % world]
            last = step == world - 1  # the last block arrived: nothing more to send
            for seconds, transfer in ((pairs * pair, forward_transfer),
                                      (2.5 * pairs * pair, backward_transfer)):
                transfer = 0.0 if last else transfer
                total += max(seconds, transfer)
                compute += seconds
                exposed += max(0.0, transfer - seconds)
        if worst is None or total > worst[0]:
            worst = (total, compute, exposed)
    plain = world * (world - 1) * block * (2 * shape.kv_row_bytes + shape.dkv_row_bytes)
    pairs = sum(map(sum, work))
    return MaskedRing(seconds=worst[0], compute_seconds=worst[1], exposed_seconds=worst[2],
                      bytes_sent=plain, plain_bytes=plain,
                      useful_flops=pairs * 3.5 * pair * shape.peak_flops)


# Walking a plan costs about seq_len x ring positions of host memory (8 bytes each, for
# block_work's running counts); past this many the plan says so instead of walking it.
MAX_WALKED_POSITIONS = 1 << 27


@dataclass(frozen=True, kw_only=True)
class MaskLine:
    """The layers that share one mask, and one layer's ring under it: ringray's step plan
    over the job's layout, and the plain ring over the same layout."""

    mask: str  # "full causal" or "window 4096", with ", documents SPEC" when packed
    layers: int
    ringray: MaskedRing
    plain: MaskedRing


def step_plan(layout: Layout, documents: list[int] | None, windows: list[int | None],
              shape: RingShape) -> tuple[MaskLine, ...]:
    """One :class:`MaskLine` per distinct window among ``windows`` (one entry per layer;
    ``None``: full causal), in first-layer order."""
    lines = []
    for window in dict.fromkeys(windows):
        label = "full causal" if window is None else f"window {window}"
        lines.append(MaskLine(
            mask=label, layers=windows.count(window),
            ringray=masked_ring(layout, documents, window, shape),
            plain=plain_ring(layout, documents, window, shape)))
    return tuple(lines)
