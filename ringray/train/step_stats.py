"""Per-step statistics of a training step, and how they are computed from the ranks' reports.

Every rank reports a few numbers (its loss sum, attention compute and exposed-communication
seconds, split into transfer not hidden and waiting for a late peer, bytes sent round the
ring and what those exchanges take alone, the messages and bytes the mask let it skip, peak
memory, and with Ulysses its all-to-alls' seconds) in one small all-gather;
:func:`summarize_step` turns the gathered table into a :class:`StepStats`. It is pure, so the
arithmetic is unit-tested without processes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ringray.attention.stats import imbalance_ratio, overlap_ratio
from ringray.train.mesh import MeshShape

# Columns of the per-rank report, in order.
REPORT_FIELDS = (
    "loss_sum",
    "attention_compute_seconds",
    "exposed_comm_seconds",
    "ring_bytes_sent",
    "ring_transfer_seconds",
    "transfer_exposed_seconds",
    "peer_wait_seconds",
    "peak_memory_bytes",
    "a2a_seconds",
    "ring_transfers_skipped",
    "ring_bytes_skipped",
)


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one optimizer step did. Per-rank lists are in global rank order."""

    step: int  # optimizer steps completed, counting this one
    loss: float  # cross-entropy, the mean over the global batch's counted labels
    grad_norm: float  # global L2 norm before clipping
    learning_rate: float
    step_seconds: float
    tokens: int  # tokens trained: the global batch's (every input token, counted labels or
    # not), less the slices of replica groups that missed the step (samples_dropped)
    tokens_per_second: float
    attention_compute_seconds: list[float]
    exposed_comm_seconds: list[float]
    # Worst rank's share of its ring transfers hidden behind compute, in [0, 1]: 1 - transfer
    # not hidden / standalone transfer. Waiting for a late peer is not in it (peer_wait_*).
    overlap_ratio: float
    load_imbalance: float  # worst CP group's max / mean attention compute
    mfu: float | None  # model FLOPs utilisation against the peak; None when no peak is known
    peak_memory_bytes: int  # largest over ranks
    # Per ring (DP index order) and per rank (global rank order), for metrics and dashboards.
    overlap_ratio_per_ring: list[float] = field(default_factory=list)  # worst rank of each
    load_imbalance_per_ring: list[float] = field(default_factory=list)
    ring_bytes_sent: list[int] = field(default_factory=list)  # this step, per rank
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)
    # Seconds in Ulysses all-to-alls per rank (all exposed: nothing computes during one);
    # zeros without Ulysses. Not part of exposed_comm_seconds, which is the ring's alone.
    a2a_seconds: list[float] = field(default_factory=list)
    # exposed_comm_seconds split per rank (ringray.attention.stats.split_exposed): the part
    # bounded by the transfers' own time, and the rest, spent waiting for a late peer.
    transfer_exposed_seconds: list[float] = field(default_factory=list)
    peer_wait_seconds: list[float] = field(default_factory=list)
    peer_wait_seconds_max: float = 0.0  # the rank that waited longest for a peer
    ring_transfer_seconds: list[float] = field(default_factory=list)  # the exchanges alone
    # What the mask saved, per rank: the plain ring's messages (K/V blocks and dK/dV sums)
    # and bytes that the transfer plan did not send (ringray.attention.transfers).
    ring_transfers_skipped: list[int] = field(default_factory=list)
    ring_bytes_skipped: list[int] = field(default_factory=list)
    # Replica groups (parallel.dp_replicate, ringray.train.replicas); the defaults describe a
    # job without them, so steps.jsonl lines from before these fields still load.
    committed: bool = True  # False: a replica failed during the step; it was not taken, and
    # the same batch is tried again (``step`` is the count before it)
    quorum_size: int = 1  # replica groups in this step's quorum (torchft)
    replicas_participating: list[int] = field(default_factory=list)  # replica indices whose
    # gradients the committed step averaged; empty without replica groups or when not committed
    samples_dropped: int = 0  # sequences of the global batch not trained on: the slices of
    # the replica groups missing from a committed step
    quorum_seconds: float = 0.0  # forming the quorum at the step's start (a heal included)
    # Non-finite steps (train.nonfinite_skips): finite False marks an attempt whose loss or
    # gradient norm was NaN or inf, so nothing was applied (``step`` is the count before it);
    # a step taken after such attempts counts them in nonfinite_skipped.
    finite: bool = True
    nonfinite_skipped: int = 0
    healed: bool = False  # this replica group loaded a live peer's state at the step's start
    heal_seconds: float = 0.0  # from asking for the quorum to the peer's state loaded

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_step(
    reports: list[list[float]],
    *,
    shape: MeshShape,
    step: int,
    grad_norm: float,
    learning_rate: float,
    step_seconds: float,
    tokens: int,
    flops_per_token: float,
    peak_flops_per_device: float | None,
    counted_labels: int | None = None,
) -> StepStats:
    """Combine the ranks' reports (``REPORT_FIELDS`` columns, one row per global rank).

    ``counted_labels``: labels the loss is a mean over (a source's loss mask and packed
    documents leave some out; a batch with none reports 0.0); ``None``: every token's."""
    rows = [dict(zip(REPORT_FIELDS, row, strict=True)) for row in reports]
    compute = [r["attention_compute_seconds"] for r in rows]
    exposed = [r["exposed_comm_seconds"] for r in rows]
    not_hidden = [r["transfer_exposed_seconds"] for r in rows]
    peer_wait = [r["peer_wait_seconds"] for r in rows]
    transfer = [r["ring_transfer_seconds"] for r in rows]
    overlaps = [overlap_ratio(e, t) for e, t in zip(not_hidden, transfer, strict=True)]
    imbalances = [
        imbalance_ratio(compute[d * shape.cp : (d + 1) * shape.cp]) for d in range(shape.dp)
    ]
    tokens_per_second = tokens / step_seconds if step_seconds > 0 else 0.0
    mfu = None
    if peak_flops_per_device:
        mfu = tokens_per_second * flops_per_token / (peak_flops_per_device * shape.world_size)
    return StepStats(
        step=step,
        loss=sum(r["loss_sum"] for r in rows) / (tokens if counted_labels is None
                                                  else max(counted_labels, 1)),
        grad_norm=grad_norm,
        learning_rate=learning_rate,
        step_seconds=step_seconds,
        tokens=tokens,
        tokens_per_second=tokens_per_second,
        attention_compute_seconds=compute,
        exposed_comm_seconds=exposed,
        overlap_ratio=min(overlaps),
        load_imbalance=max(imbalances),
        mfu=mfu,
        peak_memory_bytes=int(max(r["peak_memory_bytes"] for r in rows)),
        overlap_ratio_per_ring=[
            min(overlaps[d * shape.cp : (d + 1) * shape.cp]) for d in range(shape.dp)
        ],
        load_imbalance_per_ring=imbalances,
        ring_bytes_sent=[int(r["ring_bytes_sent"]) for r in rows],
        peak_memory_bytes_per_rank=[int(r["peak_memory_bytes"]) for r in rows],
        a2a_seconds=[r["a2a_seconds"] for r in rows],
        transfer_exposed_seconds=not_hidden,
        peer_wait_seconds=peer_wait,
        peer_wait_seconds_max=max(peer_wait),
        ring_transfer_seconds=transfer,
        ring_transfers_skipped=[int(r["ring_transfers_skipped"]) for r in rows],
        ring_bytes_skipped=[int(r["ring_bytes_skipped"]) for r in rows],
    )
