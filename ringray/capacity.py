"""Will a job fit its cluster, and can its ring hide communication? (``ringray plan``)

    cluster = parse_cluster("4x8xH100")              # ringray.accelerators; or custom_cluster
    spec = load_job_spec("jobs/llama-8b-1m-64xh100.yaml")
    report = plan_job(spec.train_options(), cluster, name=spec.name)
    print(report.format())                           # report.to_dict() for --json
    report.fits                                      # the verdict

Pure arithmetic over a job's training options (no devices, no tensors):

- **Memory**: what one rank of this project's trainer holds, term by term, is
  :mod:`ringray.train.footprint` (weights, gradients and AdamW state, replicated or sharded
  by FSDP; activations per checkpointing mode; ring buffers; FSDP's gathered blocks; the
  peak over the step); :func:`memory_breakdown` puts it against a device.
- **Overlap**: :func:`overlap_threshold_tokens` (the ``c >= F/B`` rule, derived there).
- **Ulysses × ring** (``parallel.ulysses``): the all-to-alls' traffic
  (:func:`a2a_bytes_per_layer`) on a node's links against the ring's on its slowest link,
  the time each leaves exposed per step, and the Ulysses degree to use
  (:func:`ulysses_options`, :func:`recommend_ulysses`: the rule is there).

A planning margin (:data:`MEMORY_RESERVE_RATIO` of device memory) is kept for the CUDA
context, NCCL's buffers, kernel workspaces and allocator fragmentation, which the terms above
do not count. It is a judgement, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ringray.accelerators import (  # noqa: F401 - ACCELERATORS and parse_cluster re-exported
    ACCELERATORS,
    GIB,
    Accelerator,
    ClusterShape,
    PlanError,
    custom_cluster,
    parse_cluster,
)
from ringray.attention.layouts import seq_len_divisor
from ringray.attention.ulysses import check_ulysses_heads
from ringray.model import ModelConfig
from ringray.model.rope import describe_rope
from ringray.train import TrainOptions
from ringray.train.footprint import (  # noqa: F401 - the formulas, re-exported for callers
    Footprint,
    activation_bytes_per_token,
    gathered_bytes,
    head_activation_bytes_per_token,
    kept_activation_bytes_per_token,
    kv_repeat,
    layer_activation_bytes_per_token,
    rank_footprint,
    recompute_bytes_per_token,
    ring_buffer_bytes_per_token,
)

MEMORY_RESERVE_RATIO = 0.10
"""Share of device memory left for what the accounting does not count (see module doc)."""


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What the plan reads from a job spec, with the mesh and precision resolved."""

    name: str
    model: ModelConfig
    seq_len: int
    global_batch: int
    dp: int
    cp: int
    layout: str
    bf16: bool  # bf16 compute (autocast, or FSDP's bf16 gathered weights); else fp32
    activation_checkpointing: str  # "none" | "full" | "selective"
    fsdp: bool = False  # weights, gradients and AdamW state sharded over dp x cp
    ulysses: int = 1  # ranks per Ulysses group; the ring has cp / ulysses ranks

    @property
    def ring_size(self) -> int:
        """Ranks of one ring: cp / ulysses."""
        return self.cp // self.ulysses

    def shards(self, cp: int | None = None) -> int:
        """How many ways the weights are split: dp × cp with FSDP (at ring size ``cp``,
        default the job's), else 1. FSDP over one device shards nothing."""
        return self.dp * (cp or self.cp) if self.fsdp else 1

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    @property
    def block_tokens(self) -> int:
        """Tokens of one sequence on one rank (without Ulysses, the K/V block a ring step
        sends; with it, the ring's block is its member's chunk, ``seq_len / ring_size``)."""
        return self.seq_len // self.cp

    @property
    def activation_dtype_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @classmethod
    def from_options(cls, options: TrainOptions, cluster: ClusterShape, *,
                     name: str) -> PlanInputs:
        """Resolve dp/cp (one may be null: inferred from the cluster's size) and precision
        (``auto`` is bf16: the plan is for accelerators)."""
        dp, cp, total = options.parallel.dp, options.parallel.cp, cluster.total_devices
        if dp is None or cp is None:
            missing, known = ("cp", "dp") if cp is None else ("dp", "cp")
            known_value = dp if cp is None else cp
            if total is None or known_value is None or total % known_value:
                why = ("a custom device has no cluster size" if total is None else
                       f"parallel.{known} is null too" if known_value is None else
                       f"{total} devices do not split by parallel.{known}={known_value}")
                raise PlanError(f"parallel.{missing}: null, and it cannot be inferred ({why}); "
                                f"give a number, e.g. --set parallel.{missing}=8")
            dp, cp = (dp, total // dp) if cp is None else (total // cp, cp)
        ulysses = options.parallel.ulysses
        if cp % ulysses:
            raise PlanError(f"parallel.ulysses: {ulysses} does not divide the inferred cp = "
                            f"{cp}; give parallel.cp, or a divisor of {cp}")
        train = options.train
        return cls(
            name=name, model=options.model, seq_len=train.seq_len,
            global_batch=train.global_batch, dp=dp, cp=cp, layout=options.layout_kind,
            bf16=train.precision != "fp32",
            activation_checkpointing=train.activation_checkpointing,
            fsdp=options.parallel.fsdp, ulysses=ulysses,
        )


# ------------------------------------------------------------------------------ formulas


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


# ------------------------------------------------------------------------------ the report


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown(Footprint):
    """One device's :class:`~ringray.train.footprint.Footprint` and what it may use."""

    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes


def memory_breakdown(inputs: PlanInputs, device: Accelerator, *, cp: int | None = None,
                     ulysses: int | None = None) -> MemoryBreakdown:
    """Per-device memory of ``inputs`` on ``device`` (at ``cp`` ranks per sequence as ring ×
    ``ulysses``; default the job's cp, and its ulysses at its own cp, else 1)."""
    if ulysses is None:
        ulysses = inputs.ulysses if cp is None or cp == inputs.cp else 1
    cp = cp or inputs.cp
    footprint = rank_footprint(
        inputs.model, local_tokens=inputs.local_batch * (inputs.seq_len // cp), cp=cp,
        shards=inputs.shards(cp), bf16=inputs.bf16,
        checkpointing=inputs.activation_checkpointing, ulysses=ulysses)
    return MemoryBreakdown(**asdict(footprint),
                           usable_bytes=int(device.memory_bytes * (1 - MEMORY_RESERVE_RATIO)))


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


# ------------------------------------------------------------------------------ Ulysses


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
    peak_bytes: int | None = None

    @property
    def exposed_seconds(self) -> float | None:
        if self.a2a_seconds is None or self.ring_exposed_seconds is None:
            return None
        return self.ring_exposed_seconds + self.a2a_seconds


def _a2a_link(cluster: ClusterShape) -> tuple[str, float]:
    """The link a Ulysses group's all-to-all runs on: inside one node (placement keeps a
    group there), the accelerator's intra-node link; a custom device's one link."""
    return cluster.ring_link(1)


def ulysses_options(inputs: PlanInputs, cluster: ClusterShape) -> tuple[UlyssesOption, ...]:
    """Every divisor U of the job's cp, ascending, with its per-step figures, and why the
    job cannot use it: a group larger than a node (placement keeps a group on one node),
    heads that do not split over it, a sequence length the grid's layout cannot split, or
    memory that does not fit."""
    cfg, cp = inputs.model, inputs.cp
    _, link_rate = _a2a_link(cluster)
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
        memory = memory_breakdown(inputs, cluster.accelerator, cp=cp, ulysses=ulysses)
        if refused is None and not memory.fits:
            refused = (f"peak {memory.peak_bytes / GIB:.1f} GiB over the "
                       f"{memory.usable_bytes / GIB:.1f} GiB usable")
        options.append(UlyssesOption(
            ulysses=ulysses, ring_size=ring.ring_size, a2a_bytes_per_layer=forward + backward,
            a2a_seconds=cfg.n_layers * (forward + backward) / link_rate,
            ring_transfer_seconds=cfg.n_layers * ring.transfer_seconds_per_layer,
            ring_exposed_seconds=cfg.n_layers * ring.exposed_seconds_per_layer,
            ring_hidden=ring.hidden, peak_bytes=memory.peak_bytes, refused=refused,
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


def _layout_note(layout: str, cp: int) -> str:
    if layout == "contiguous" and cp > 1:
        return (f"contiguous is unbalanced under causal attention: the last rank does "
                f"{(2 * cp - 1) / cp:.2f}x the mean work and rank 0 idles after its own block; "
                f"use zigzag")
    if layout == "striped":
        return "striped is as balanced as zigzag (every rank computes half of each block)"
    return "zigzag: every rank computes half of each block (balanced under causal attention)"


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """The plan of one job on one cluster; :meth:`format` for people, :meth:`to_dict` for
    machines."""

    inputs: PlanInputs
    cluster: ClusterShape
    memory: MemoryBreakdown
    overlap: OverlapCheck
    devices_needed: int
    recommended_cp: int | None
    recommended_layout: str
    layout_note: str
    fits: bool
    reasons: tuple[str, ...]  # why it does not fit (empty when it fits)
    ulysses_options: tuple[UlyssesOption, ...] = ()  # every divisor of cp (ulysses_options)
    recommended_ulysses: int = 1

    @property
    def job_ulysses(self) -> UlyssesOption | None:
        """The figures of the job's own ring × ulysses."""
        return next((option for option in self.ulysses_options
                     if option.ulysses == self.inputs.ulysses), None)

    @property
    def verdict(self) -> str:
        if self.fits:
            mem = self.memory
            return (f"fits: {mem.peak_bytes / GIB:.1f} GiB of {mem.usable_bytes / GIB:.1f} GiB "
                    f"usable per device")
        return "does not fit: " + "; ".join(self.reasons)

    def to_dict(self) -> dict:
        inputs = asdict(self.inputs)
        inputs["model"] = {"num_params": self.inputs.model.num_params(), **inputs["model"]}
        inputs.update(local_batch=self.inputs.local_batch, block_tokens=self.inputs.block_tokens)
        return {
            "job": inputs,
            "cluster": {"description": self.cluster.describe(), "nodes": self.cluster.nodes,
                        "gpus_per_node": self.cluster.gpus_per_node,
                        **asdict(self.cluster.accelerator)},
            "memory": {**asdict(self.memory), "static_bytes": self.memory.static_bytes},
            "overlap": {**asdict(self.overlap), "threshold_tokens": self.overlap.threshold_tokens,
                        "hidden": self.overlap.hidden},
            "ulysses": [{**asdict(option), "exposed_seconds": option.exposed_seconds}
                        for option in self.ulysses_options],
            "recommended_ulysses": self.recommended_ulysses,
            "ulysses_rule": ULYSSES_RULE,
            "devices_needed": self.devices_needed,
            "recommended_cp": self.recommended_cp,
            "recommended_layout": self.recommended_layout,
            "layout_note": self.layout_note,
            "fits": self.fits,
            "reasons": list(self.reasons),
            "verdict": self.verdict,
        }

    def format(self) -> str:
        """A plain-text report (no colour, no box drawing): what a terminal or a log shows."""
        i, c = self.inputs, self.cluster
        cfg, acc = i.model, c.accelerator
        params = cfg.num_params()
        size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
        shards = i.shards()
        if shards > 1:
            precision = (f"{'bf16 weights gathered from fp32' if i.bf16 else 'fp32'} shards "
                         f"(FSDP over dp x cp = {shards})")
        else:
            precision = ("bf16 autocast over fp32 weights" if i.bf16 else "fp32") + \
                ", replicated"
        checkpointing = {"none": "none", "full": "full (each block, ring pass included)",
                         "selective": "selective (all but the ring pass)"}
        if self.recommended_cp is None:
            recommended = f"no cp fits (layout {self.recommended_layout})"
        else:
            recommended = f"cp {self.recommended_cp}, layout {self.recommended_layout}"
        grid = (f" = ring {i.ring_size} x ulysses {i.ulysses}" if i.ulysses > 1 else "")
        return "\n".join([
            f"job {i.name!r} on {c.describe()}: {acc.peak_flops / 1e12:g} TFLOP/s bf16, "
            f"{acc.memory_bytes / GIB:g} GiB per device",
            f"model: {size} parameters, {cfg.n_layers} layers, dim {cfg.dim}, heads "
            f"{cfg.n_heads}/{cfg.n_kv_heads}, ffn {cfg.ffn_hidden}",
            f"mesh: dp {i.dp} x cp {i.cp}{grid} ({i.layout}) = {self.devices_needed} devices; seq "
            f"{i.seq_len}; per device {i.local_batch} sequence(s) x {i.block_tokens} tokens",
            f"precision: {precision}",
            f"activation checkpointing: {checkpointing[i.activation_checkpointing]}",
            f"rope: {describe_rope(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim)}",
            "",
            *self._memory_lines(),
            "",
            *self._overlap_lines(),
            "",
            *self._ulysses_lines(),
            f"recommended: {recommended}",
            f"  {self.layout_note}",
            *self._recommended_ulysses_lines(),
            "",
            f"verdict: {self.verdict}",
        ])

    def _memory_lines(self) -> list[str]:
        m, acc, bf16 = self.memory, self.cluster.accelerator, self.inputs.bf16
        shards = self.inputs.shards()
        share = f", 1/{shards}" if shards > 1 else ""
        copies = " + bf16 autocast copies" if bf16 and shards == 1 else ""
        rows = [
            (f"weights (fp32{copies}{share})", m.weights_bytes),
            (f"gradients (fp32{share})", m.gradients_bytes),
            (f"AdamW moments (fp32 x 2{share})", m.optimizer_bytes),
            ("activations kept by the forward", m.kept_activations_bytes),
            (f"recomputed at once ({self.inputs.activation_checkpointing} checkpointing)",
             m.recompute_bytes),
            ("ring buffers (one layer, backward)", m.ring_buffers_bytes),
            *([("FSDP gathered weights and gradients", m.gathered_bytes)] if shards > 1 else []),
            ("step transient (after backward)", m.step_transient_bytes),
            (f"peak (at the {m.peak_moment})", m.peak_bytes),
            (f"usable ({acc.memory_bytes / GIB:g} GiB less {MEMORY_RESERVE_RATIO:.0%} reserve)",
             m.usable_bytes),
        ]
        return [f"{'memory per device':<46}{'GiB':>7}"] + [
            f"  {label:<44}{value / GIB:>7.2f}" for label, value in rows
        ]

    def _overlap_lines(self) -> list[str]:
        o, layout = self.overlap, self.inputs.layout
        if o.ring_size == 1:
            if o.ulysses > 1:
                return [f"ring overlap: a ring of 1 (cp {self.inputs.cp} = ulysses "
                        f"{o.ulysses}), nothing to send, nothing to hide"]
            return ["ring overlap: cp 1, no ring (nothing to send, nothing to hide)"]
        notes = ([f"2 zigzag chunks of {o.block_tokens // 2}"] if layout == "zigzag" else [])
        if o.ulysses > 1:
            notes.append(f"its Ulysses group's {o.ulysses} shares")
        chunks = f" ({'; '.join(notes)})" if notes else ""
        per = "per ring rank" if o.ulysses > 1 else "per rank"
        return [
            f"ring overlap ({o.link}, {o.link_bytes_per_second / 1e9:g} GB/s one way, "
            f"{o.peak_flops / 1e12:g} TFLOP/s)",
            f"  threshold block   {o.threshold_tokens} tokens (forward "
            f"{math.ceil(o.forward_threshold_tokens)}, backward "
            f"{math.ceil(o.backward_threshold_tokens)}: c >= F/B x constant)",
            f"  this job's block  {o.block_tokens} tokens {per}{chunks}: communication "
            + ("hidden" if o.hidden else "exposed"),
            f"  forward step      {o.forward_compute_seconds * 1e3:.3g} ms compute at peak, "
            f"{o.forward_transfer_seconds * 1e3:.3g} ms transfer (one layer)",
        ]

    def _recommended_ulysses_lines(self) -> list[str]:
        if len(self.ulysses_options) < 2:
            return []
        u, cp = self.recommended_ulysses, self.inputs.cp
        return [f"recommended at cp {cp}: ulysses {u} (ring {cp // u} x ulysses {u}): "
                f"{ULYSSES_RULE}"]

    def _ulysses_lines(self) -> list[str]:
        """Each ring x ulysses split of the job's cp: all-to-all seconds beside the ring's."""
        options = self.ulysses_options
        if len(options) < 2:
            return []
        link, rate = _a2a_link(self.cluster)
        lines = [
            f"ulysses x ring at cp {self.inputs.cp}: ms per step (every layer, forward and "
            f"backward, at peak compute); all-to-alls on {link} ({rate / 1e9:g} GB/s one way), "
            f"all exposed",
            f"  {'ulysses':>7} {'ring':>5} {'a2a':>9} {'ring transfer':>14} "
            f"{'ring exposed':>13}  {'ring is':<8} {'exposed':>9}",
        ]
        for option in options:
            mark = "  <- this job" if option.ulysses == self.inputs.ulysses else ""
            head = f"  {option.ulysses:>7} {option.ring_size:>5}"
            if option.exposed_seconds is None:
                lines.append(f"{head}   not allowed: {option.refused}{mark}")
                continue
            hidden = "hidden" if option.ring_hidden else "exposed"
            refused = f"  not allowed: {option.refused}" if option.refused else ""
            lines.append(
                f"{head} {_ms(option.a2a_seconds):>9} {_ms(option.ring_transfer_seconds):>14} "
                f"{_ms(option.ring_exposed_seconds):>13}  {hidden:<8} "
                f"{_ms(option.exposed_seconds):>9}{refused}{mark}")
        return [*lines, ""]


def _ms(seconds: float) -> str:
    """Milliseconds to about three significant digits, without an exponent."""
    ms = seconds * 1e3
    if ms == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(ms))))
    return f"{ms:,.{decimals}f}"


def _candidate_cps(inputs: PlanInputs, cluster: ClusterShape, layout: str) -> list[int]:
    """Ring sizes the layout can split the sequence over, within the cluster (ascending)."""
    total = cluster.total_devices
    limit = inputs.seq_len if total is None else total // inputs.dp
    divisors = {n for d in range(1, math.isqrt(inputs.seq_len) + 1) if inputs.seq_len % d == 0
                for n in (d, inputs.seq_len // d)}
    return sorted(cp for cp in divisors
                  if cp <= limit and inputs.seq_len % seq_len_divisor(layout, cp) == 0)


def recommend_cp(inputs: PlanInputs, cluster: ClusterShape, layout: str) -> int | None:
    """The smallest ring that fits memory, preferring one whose block meets the overlap
    threshold. A larger cp only shrinks the block (and may cross nodes onto a slower link),
    so when the smallest fitting cp misses the threshold, every larger one does too; it is
    still the best choice, with communication exposed. None when no cp fits. (Plain rings:
    the Ulysses degree is recommended at the job's cp, :func:`recommend_ulysses`.)"""
    fitting = [cp for cp in _candidate_cps(inputs, cluster, layout)
               if memory_breakdown(inputs, cluster.accelerator, cp=cp, ulysses=1).fits]
    hidden = [cp for cp in fitting
              if overlap_check(inputs, cluster, cp=cp, ulysses=1).hidden]
    return (hidden or fitting or [None])[0]


def plan(inputs: PlanInputs, cluster: ClusterShape) -> PlanReport:
    """Memory, overlap, recommendation and verdict of ``inputs`` on ``cluster``."""
    memory = memory_breakdown(inputs, cluster.accelerator)
    devices_needed = inputs.dp * inputs.cp
    reasons = []
    if cluster.total_devices is not None and devices_needed > cluster.total_devices:
        reasons.append(f"dp {inputs.dp} x cp {inputs.cp} = {devices_needed} devices, the "
                       f"cluster has {cluster.total_devices}")
    if memory.static_bytes > memory.usable_bytes:
        where = (f"sharded over {inputs.shards()} devices" if inputs.shards() > 1 else
                 "replicated on every device, so no cp helps")
        reasons.append(
            f"weights, gradients and AdamW state alone need {memory.static_bytes / GIB:.1f} GiB "
            f"per device, {(memory.static_bytes - memory.usable_bytes) / GIB:.1f} GiB over the "
            f"{memory.usable_bytes / GIB:.1f} GiB usable ({where}){_remedies(inputs, cluster)}")
    elif not memory.fits:
        over = memory.peak_bytes - memory.usable_bytes
        reasons.append(
            f"peak {memory.peak_bytes / GIB:.1f} GiB per device is {over / GIB:.1f} GiB over "
            f"the {memory.usable_bytes / GIB:.1f} GiB usable: activations take "
            f"{memory.activations_bytes / GIB:.1f} GiB at {inputs.block_tokens} tokens per rank"
            f"{_remedies(inputs, cluster)}")
    grids = ulysses_options(inputs, cluster)
    own = next(option for option in grids if option.ulysses == inputs.ulysses)
    if own.refused is not None and not own.refused.startswith("peak"):  # memory: above
        reasons.append(f"parallel.ulysses: {inputs.ulysses} is not allowed here: "
                       f"{own.refused}")
    layout = inputs.layout if inputs.layout in ("zigzag", "striped") else "zigzag"
    return PlanReport(
        inputs=inputs, cluster=cluster, memory=memory, overlap=overlap_check(inputs, cluster),
        devices_needed=devices_needed, recommended_cp=recommend_cp(inputs, cluster, layout),
        recommended_layout=layout, layout_note=_layout_note(inputs.layout, inputs.cp),
        fits=not reasons, reasons=tuple(reasons), ulysses_options=grids,
        recommended_ulysses=recommend_ulysses(grids),
    )


def _remedies(inputs: PlanInputs, cluster: ClusterShape) -> str:
    """``; lower peaks: parallel.fsdp: true 51.2 GiB, + selective checkpointing 40.3 GiB``:
    the peak with each setting that lowers it, cumulatively (FSDP when it is off, then
    lighter activation checkpointing)."""
    changes = []
    if not inputs.fsdp and inputs.dp * inputs.cp > 1:
        changes.append(("parallel.fsdp: true", {"fsdp": True}))
    modes = ("none", "selective", "full")
    for mode in modes[modes.index(inputs.activation_checkpointing) + 1:]:
        changes.append((f"{mode} checkpointing", {"activation_checkpointing": mode}))
    hints, applied = [], {}
    for label, change in changes:
        applied.update(change)
        peak = memory_breakdown(replace(inputs, **applied), cluster.accelerator).peak_bytes
        hints.append(f"{'+ ' if hints else ''}{label} {peak / GIB:.1f} GiB")
    return f"; lower peaks: {', '.join(hints)}" if hints else ""


def plan_job(options: TrainOptions, cluster: ClusterShape, *, name: str) -> PlanReport:
    """:func:`plan` for a job's training options (``name``: the job's, for the report)."""
    return plan(PlanInputs.from_options(options, cluster, name=name), cluster)
