"""One configuration against one device and link: per-device memory
(:func:`memory_breakdown`, over :mod:`ringray.train.footprint`, and NCCL's buffers beside it,
:mod:`ringray.capacity.nccl`) and whether a ring step hides its transfer
(:func:`overlap_threshold_tokens`, the ``c >= F/B`` rule, and :func:`overlap_check`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ringray.accelerators import ClusterShape
from ringray.capacity.inputs import PlanInputs
from ringray.capacity.nccl import CommBuffers, comm_buffers
from ringray.model import ModelConfig
from ringray.train.footprint import Footprint, kv_repeat, rank_footprint
from ringray.train.memory_check import MEMORY_RESERVE_RATIO as MEMORY_RESERVE_RATIO
from ringray.train.memory_check import usable_bytes

# MEMORY_RESERVE_RATIO and usable_bytes live with the check before a start (one reserve for
# the plan and that check); re-exported here, where ringray.capacity's callers find them.


def overlap_threshold_tokens(
    cfg: ModelConfig, *, peak_flops: float, link_bytes_per_second: float, bf16: bool,
    causal: bool = True, kv_repeat: int = 1,
) -> tuple[float, float]:
    """The smallest block (tokens of one sequence per rank) whose ring step hides its
    transfer, for the forward and the backward pass.

    A step attends the rank's ``c`` queries to an incoming ``c``-token block. With
    ``F`` = peak FLOP/s and ``B`` = link bytes/s (one direction)::

        forward   compute = r * 4 c^2 e h   (QK^T and PV: 2 c^2 e FLOPs each, per head)
                  transfer = 2 c k e a      (K and V at the kv-head count)
                  c >= (F / B) * k a / (2 r h)
        backward  compute = 2.5 x forward  (5 matmuls: recomputed QK^T, dV, dP, dQ, dK)
                  transfer = 2 c k e (a + 4) (the K/V block and its float32 dK/dV sum)
                  c >= (F / B) * k (a + 4) / (5 r h)

    ``r`` is the share of a block's (query, key) pairs that a step computes: 1 for full
    attention, 1/2 for causal attention under a balanced layout (zigzag and striped give
    every rank half of every other rank's block). For multi-head attention in bf16 the
    forward rule is Ring Attention's ``c >= F/B`` (Liu, Zaharia and Abbeel, 2023) for full
    attention and ``c >= 2F/B`` for causal. ``F`` is the dense peak: a kernel below peak
    makes compute longer and the real threshold lower, so this one is conservative.

    With Ulysses (U ranks per group) a ring rank holds its member's chunk, ``c_R = U c``
    tokens, for ``h / U`` query and ``k r / U`` kv heads (``r = kv_repeat``: the K/V copies
    when U > k). The rule is the same with ``c_R`` for ``c`` and ``k r`` for ``k`` (the U's
    cancel): the threshold is on the ring's block ``c_R``, which is U times the rank's share.
    """
    h, k = cfg.n_heads, cfg.n_kv_heads * kv_repeat
    a = 2 if bf16 else 4
    share = 0.5 if causal else 1.0
    ratio = peak_flops / link_bytes_per_second
    forward = ratio * k * a / (2 * share * h)
    backward = ratio * k * (a + 4) / (5 * share * h)
    return forward, backward


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown(Footprint):
    """One device's :class:`~ringray.train.footprint.Footprint` (PyTorch's allocations),
    NCCL's buffers beside it (:class:`~ringray.capacity.nccl.CommBuffers`, outside
    PyTorch's caching allocator), and what the device may use."""

    usable_bytes: int
    comm: CommBuffers

    @property
    def device_bytes(self) -> int:
        """What the device holds at the step's peak: PyTorch's peak and NCCL's buffers."""
        return self.peak_bytes + self.comm.total_bytes

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.usable_bytes


def plan_footprint(inputs: PlanInputs, *, cp: int | None = None,
                   ulysses: int | None = None) -> Footprint:
    """One rank's memory for ``inputs`` at ``cp`` ranks per sequence as ring × ``ulysses``
    (default the job's cp, and its ulysses at its own cp, else 1)."""
    if ulysses is None:
        ulysses = inputs.ulysses if cp is None or cp == inputs.cp else 1
    cp = cp or inputs.cp
    return rank_footprint(
        inputs.model, local_tokens=inputs.local_batch * (inputs.seq_len // cp), cp=cp,
        shards=inputs.shards(cp), bf16=inputs.bf16,
        checkpointing=inputs.activation_checkpointing, ulysses=ulysses,
        ranks=inputs.dp * cp, foreach=inputs.foreach)


def memory_breakdown(inputs: PlanInputs, cluster: ClusterShape, *, cp: int | None = None,
                     ulysses: int | None = None) -> MemoryBreakdown:
    """Per-device memory of ``inputs`` on ``cluster``'s devices (at ``cp`` ranks per sequence
    as ring × ``ulysses``; default the job's cp, and its ulysses at its own cp, else 1)."""
    footprint = plan_footprint(inputs, cp=cp, ulysses=ulysses)
    return MemoryBreakdown(**asdict(footprint),
                           usable_bytes=usable_bytes(cluster.accelerator.memory_bytes),
                           comm=comm_buffers(inputs, cluster, cp=cp, ulysses=ulysses))


@dataclass(frozen=True, kw_only=True)
class OverlapCheck:
    """Can a ring step hide its transfer behind its attention compute? (With Ulysses, the
    ring of ``ring_size`` = cp / ulysses ranks, each holding its member's chunk for its
    share of the heads.)"""

    ring_size: int
    link: str
    link_bytes_per_second: float
    peak_flops: float
    block_tokens: int  # the ring's block: tokens of one sequence per ring rank
    forward_threshold_tokens: float
    backward_threshold_tokens: float
    forward_compute_seconds: float  # one ring step of one layer, this rank's whole batch
    forward_transfer_seconds: float
    backward_compute_seconds: float = 0.0  # the same step in the backward
    backward_transfer_seconds: float = 0.0  # its K/V block and float32 dK/dV sum
    ulysses: int = 1

    @property
    def threshold_tokens(self) -> int:
        return math.ceil(max(self.forward_threshold_tokens, self.backward_threshold_tokens))

    @property
    def hidden(self) -> bool:
        """True when every ring step's transfer fits under its compute (a ring of 1: none)."""
        return self.ring_size == 1 or self.block_tokens >= self.threshold_tokens

    @property
    def transfer_seconds_per_layer(self) -> float:
        """One layer's ring transfers, forward and backward: ring_size - 1 steps each (the
        last step's block is already here)."""
        steps = self.ring_size - 1
        return steps * (self.forward_transfer_seconds + self.backward_transfer_seconds)

    @property
    def exposed_seconds_per_layer(self) -> float:
        """What one layer's ring steps leave exposed at peak compute: each step waits for
        whatever of its transfer its compute does not cover."""
        steps = self.ring_size - 1
        return steps * (max(0.0, self.forward_transfer_seconds - self.forward_compute_seconds)
                        + max(0.0, self.backward_transfer_seconds
                              - self.backward_compute_seconds))


def overlap_check(inputs: PlanInputs, cluster: ClusterShape, *, cp: int | None = None,
                  ulysses: int | None = None) -> OverlapCheck:
    """The overlap rule at ``cp`` ranks per sequence as ring × ``ulysses`` (default the
    job's; ulysses 1 at another cp) on the ring's slowest link.

    Per ring step and layer, for this rank's batch, with ``c_R`` = seq_len / ring_size the
    ring's block, ``h / U`` query and ``k r / U`` kv heads (``r``: the K/V repeat)::

        forward   compute  = share x 4 c_R^2 e (h / U) / F
                  transfer = 2 c_R (k r / U) e a / B
        backward  compute  = 2.5 x forward
                  transfer = 2 c_R (k r / U) e (a + 4) / B

    So against the plain ring at the same cp (c_R = U c), a step computes U times as much
    and sends r times as much (the same when U <= k), over cp / U - 1 steps instead of
    cp - 1: the same total compute, less total transfer, and each transfer easier to hide.
    """
    if ulysses is None:
        ulysses = inputs.ulysses if cp is None or cp == inputs.cp else 1
    cp = cp or inputs.cp
    cfg, device = inputs.model, cluster.accelerator
    ring_size, repeat = cp // ulysses, kv_repeat(cfg, ulysses)
    link, link_rate = cluster.ring_link(cp)
    forward, backward = overlap_threshold_tokens(
        cfg, peak_flops=device.peak_flops, link_bytes_per_second=link_rate, bf16=inputs.bf16,
        kv_repeat=repeat)
    block, batch = inputs.seq_len // ring_size, inputs.local_batch
    q_heads, kv_heads = cfg.n_heads / ulysses, cfg.n_kv_heads * repeat / ulysses
    compute = batch * 0.5 * 4 * block**2 * cfg.head_dim * q_heads / device.peak_flops
    kv_bytes = batch * 2 * block * kv_heads * cfg.head_dim
    a = inputs.activation_dtype_bytes
    return OverlapCheck(
        ring_size=ring_size, link=link, link_bytes_per_second=link_rate,
        peak_flops=device.peak_flops, block_tokens=block, forward_threshold_tokens=forward,
        backward_threshold_tokens=backward, forward_compute_seconds=compute,
        forward_transfer_seconds=kv_bytes * a / link_rate,
        backward_compute_seconds=2.5 * compute,
        backward_transfer_seconds=kv_bytes * (a + 4) / link_rate, ulysses=ulysses,
    )
