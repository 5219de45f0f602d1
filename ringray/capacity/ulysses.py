"""Ulysses × ring at a job's cp: each Ulysses degree's all-to-all traffic
(:func:`a2a_bytes_per_layer`) on a node's links against the ring's on its slowest link, the
time each leaves exposed per step (:func:`ulysses_options`), and the degree to use
(:func:`recommend_ulysses`: the rule is there)."""

from __future__ import annotations

from dataclasses import dataclass

from ringray.accelerators import GIB, ClusterShape
from ringray.attention.layouts import seq_len_divisor
from ringray.attention.ulysses import check_ulysses_heads
from ringray.capacity.fit import memory_breakdown, overlap_check
from ringray.capacity.inputs import PlanInputs
from ringray.model import ModelConfig
from ringray.train.footprint import kv_repeat


def a2a_bytes_per_layer(cfg: ModelConfig, *, local_tokens: int, ulysses: int, bf16: bool
                        ) -> tuple[int, int]:
    """Bytes one rank sends in one layer's Ulysses all-to-alls, (forward, backward), for its
    ``local_tokens`` (its sequences' shares). Each all-to-all keeps 1/U of its buffer and
    sends the rest (``(U - 1) / U``); with ``a`` bytes per element, ``h``/``k`` query/kv
    heads, ``e`` = head_dim and ``r`` the K/V repeat (:func:`kv_repeat`)::

        forward   q, k, v to heads     (U-1)/U x tokens x (h + 2 k r) e a
                  the output back      (U-1)/U x tokens x h e a
        backward  dout to heads        (U-1)/U x tokens x h e a
                  dq, dk, dv back      (U-1)/U x tokens x (h + 2 k r) e a

    The backward is the forward's mirror (dK/dV travel as K/V did), so the two are equal.
    """
    if ulysses == 1:
        return 0, 0
    a = 2 if bf16 else 4
    heads = 2 * cfg.n_heads + 2 * cfg.n_kv_heads * kv_repeat(cfg, ulysses)
    sent = (ulysses - 1) * local_tokens * heads * cfg.head_dim * a // ulysses
    return sent, sent


@dataclass(frozen=True, kw_only=True)
class UlyssesOption:
    """One way to run ``cp`` ranks per sequence: a ring of ``ring_size`` × ``ulysses``, with
    what it leaves exposed per optimizer step (every layer, forward and backward) at peak
    compute. ``refused`` says why the job cannot use it (``None``: it can)."""

    ulysses: int
    ring_size: int
    refused: str | None = None
    # The figures; None where the heads cannot be shared over ``ulysses`` ranks at all.
    a2a_bytes_per_layer: int | None = None  # forward + backward, one rank
    a2a_seconds: float | None = None  # per step: all exposed (nothing computes meanwhile)
    ring_transfer_seconds: float | None = None  # per step
    ring_exposed_seconds: float | None = None  # per step: what the ring's compute leaves
    ring_hidden: bool | None = None  # every ring step's transfer fits under its compute
    peak_bytes: int | None = None  # the device at its peak, NCCL's buffers included

    @property
    def exposed_seconds(self) -> float | None:
        if self.a2a_seconds is None or self.ring_exposed_seconds is None:
            return None
        return self.ring_exposed_seconds + self.a2a_seconds


def a2a_link(cluster: ClusterShape) -> tuple[str, float]:
    """The link a Ulysses group's all-to-all runs on: inside one node (placement keeps a
    group there), the accelerator's intra-node link; a custom device's one link."""
    return cluster.ring_link(1)


def ulysses_options(inputs: PlanInputs, cluster: ClusterShape) -> tuple[UlyssesOption, ...]:
    """Every divisor U of the job's cp, ascending, with its per-step figures, and why the
    job cannot use it: a group larger than a node (placement keeps a group on one node),
    heads that do not split over it, a sequence length the grid's layout cannot split, or
    memory that does not fit."""
    cfg, cp = inputs.model, inputs.cp
    _, link_rate = a2a_link(cluster)
    local_tokens = inputs.local_batch * (inputs.seq_len // cp)
    options = []
    for ulysses in (u for u in range(1, cp + 1) if cp % u == 0):
        refused = _ulysses_refusal(inputs, cluster, ulysses)
        try:
            kv_repeat(cfg, ulysses)
        except ValueError:  # no figures: the heads cannot be shared over this group at all
            options.append(UlyssesOption(ulysses=ulysses, ring_size=cp // ulysses,
                                         refused=refused))
            continue
        forward, backward = a2a_bytes_per_layer(cfg, local_tokens=local_tokens,
                                                ulysses=ulysses, bf16=inputs.bf16)
        ring = overlap_check(inputs, cluster, cp=cp, ulysses=ulysses)
        memory = memory_breakdown(inputs, cluster, cp=cp, ulysses=ulysses)
        if refused is None and not memory.fits:
            refused = (f"peak {memory.device_bytes / GIB:.1f} GiB (NCCL's buffers included) "
                       f"over the {memory.usable_bytes / GIB:.1f} GiB usable")
        options.append(UlyssesOption(
            ulysses=ulysses, ring_size=ring.ring_size, a2a_bytes_per_layer=forward + backward,
            a2a_seconds=cfg.n_layers * (forward + backward) / link_rate,
            ring_transfer_seconds=cfg.n_layers * ring.transfer_seconds_per_layer,
            ring_exposed_seconds=cfg.n_layers * ring.exposed_seconds_per_layer,
            ring_hidden=ring.hidden, peak_bytes=memory.device_bytes, refused=refused,
        ))
    return tuple(options)


def _ulysses_refusal(inputs: PlanInputs, cluster: ClusterShape, ulysses: int) -> str | None:
    cfg = inputs.model
    if cluster.gpus_per_node is not None and ulysses > cluster.gpus_per_node:
        return f"a group of {ulysses} does not fit a node of {cluster.gpus_per_node}"
    try:
        check_ulysses_heads(cfg.n_heads, cfg.n_kv_heads, ulysses)
    except ValueError:
        return f"heads {cfg.n_heads}/{cfg.n_kv_heads} do not split over {ulysses}"
    if inputs.seq_len % seq_len_divisor(inputs.layout, inputs.cp, ulysses):
        return (f"seq {inputs.seq_len} is not a multiple of "
                f"{seq_len_divisor(inputs.layout, inputs.cp, ulysses)}")
    return None


ULYSSES_RULE = ("the largest allowed ulysses whose exposed time (ring exposed + all-to-all) "
                "is no worse than the plain ring's")


def recommend_ulysses(options: tuple[UlyssesOption, ...]) -> int:
    """The Ulysses degree to use: the largest allowed U whose exposed seconds per step (the
    ring's exposed transfer plus the all-to-alls, which nothing hides) are no worse than
    the plain ring's (U = 1). Why the largest: at equal or lower exposed time a larger U
    means a shorter ring (fewer steps, each with a larger block, and fewer hops per step
    when the ring spans nodes) and attention over U times longer sequences per kernel call,
    which run closer to peak (the issue's H100 figures: Ulysses about 580 TFLOP/s per GPU,
    ring P2P 430-475); the model counts neither, so it only guards exposed time. When the
    plain ring already hides its transfers, every U > 1 only adds all-to-all time, and the
    answer is 1."""
    plain = next(option for option in options if option.ulysses == 1).exposed_seconds
    allowed = [option.ulysses for option in options
               if option.refused is None and option.exposed_seconds <= plain * (1 + 1e-9)]
    return max(allowed, default=1)
