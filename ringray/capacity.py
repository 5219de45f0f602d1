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
from ringray.model import ModelConfig
from ringray.model.rope import describe_rope
from ringray.train import TrainOptions
from ringray.train.footprint import (  # noqa: F401 - the formulas, re-exported for callers
    Footprint,
    activation_bytes_per_token,
    gathered_bytes,
    head_activation_bytes_per_token,
    kept_activation_bytes_per_token,
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

    def shards(self, cp: int | None = None) -> int:
        """How many ways the weights are split: dp × cp with FSDP (at ring size ``cp``,
        default the job's), else 1. FSDP over one device shards nothing."""
        return self.dp * (cp or self.cp) if self.fsdp else 1

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    @property
    def block_tokens(self) -> int:
        """Tokens of one sequence on one rank: the K/V block a ring step sends."""
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
        train = options.train
        return cls(
            name=name, model=options.model, seq_len=train.seq_len,
            global_batch=train.global_batch, dp=dp, cp=cp, layout=options.parallel.layout,
            bf16=train.precision != "fp32",
            activation_checkpointing=train.activation_checkpointing,
            fsdp=options.parallel.fsdp,
        )


# ------------------------------------------------------------------------------ formulas


def overlap_threshold_tokens(
    cfg: ModelConfig, *, peak_flops: float, link_bytes_per_second: float, bf16: bool,
    causal: bool = True,
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
    """
    h, k = cfg.n_heads, cfg.n_kv_heads
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


def memory_breakdown(inputs: PlanInputs, device: Accelerator, *, cp: int | None = None
                     ) -> MemoryBreakdown:
    """Per-device memory of ``inputs`` on ``device`` (at ring size ``cp``, default the job's)."""
    cp = cp or inputs.cp
    footprint = rank_footprint(
        inputs.model, local_tokens=inputs.local_batch * (inputs.seq_len // cp), cp=cp,
        shards=inputs.shards(cp), bf16=inputs.bf16,
        checkpointing=inputs.activation_checkpointing)
    return MemoryBreakdown(**asdict(footprint),
                           usable_bytes=int(device.memory_bytes * (1 - MEMORY_RESERVE_RATIO)))


@dataclass(frozen=True, kw_only=True)
class OverlapCheck:
    """Can a ring step hide its transfer behind its attention compute?"""

    ring_size: int
    link: str
    link_bytes_per_second: float
    peak_flops: float
    block_tokens: int
    forward_threshold_tokens: float
    backward_threshold_tokens: float
    forward_compute_seconds: float  # one ring step of one layer, this rank's whole batch
    forward_transfer_seconds: float

    @property
    def threshold_tokens(self) -> int:
        return math.ceil(max(self.forward_threshold_tokens, self.backward_threshold_tokens))

    @property
    def hidden(self) -> bool:
        """True when every ring step's transfer fits under its compute (cp 1: no ring)."""
        return self.ring_size == 1 or self.block_tokens >= self.threshold_tokens


def overlap_check(inputs: PlanInputs, cluster: ClusterShape, *, cp: int | None = None
                  ) -> OverlapCheck:
    """The overlap rule at ring size ``cp`` (default the job's) on the ring's slowest link."""
    cp = cp or inputs.cp
    cfg, device = inputs.model, cluster.accelerator
    link, link_rate = cluster.ring_link(cp)
    forward, backward = overlap_threshold_tokens(
        cfg, peak_flops=device.peak_flops, link_bytes_per_second=link_rate, bf16=inputs.bf16)
    block, batch = inputs.seq_len // cp, inputs.local_batch
    compute = batch * 0.5 * 4 * block**2 * cfg.head_dim * cfg.n_heads / device.peak_flops
    transfer = batch * 2 * block * cfg.n_kv_heads * cfg.head_dim * inputs.activation_dtype_bytes
    return OverlapCheck(
        ring_size=cp, link=link, link_bytes_per_second=link_rate, peak_flops=device.peak_flops,
        block_tokens=block, forward_threshold_tokens=forward,
        backward_threshold_tokens=backward, forward_compute_seconds=compute,
        forward_transfer_seconds=transfer / link_rate,
    )


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
        return "\n".join([
            f"job {i.name!r} on {c.describe()}: {acc.peak_flops / 1e12:g} TFLOP/s bf16, "
            f"{acc.memory_bytes / GIB:g} GiB per device",
            f"model: {size} parameters, {cfg.n_layers} layers, dim {cfg.dim}, heads "
            f"{cfg.n_heads}/{cfg.n_kv_heads}, ffn {cfg.ffn_hidden}",
            f"mesh: dp {i.dp} x cp {i.cp} ({i.layout}) = {self.devices_needed} devices; seq "
            f"{i.seq_len}; per device {i.local_batch} sequence(s) x {i.block_tokens} tokens",
            f"precision: {precision}",
            f"activation checkpointing: {checkpointing[i.activation_checkpointing]}",
            f"rope: {describe_rope(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim)}",
            "",
            *self._memory_lines(),
            "",
            *self._overlap_lines(),
            "",
            f"recommended: {recommended}",
            f"  {self.layout_note}",
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
            return ["ring overlap: cp 1, no ring (nothing to send, nothing to hide)"]
        chunks = f" (2 zigzag chunks of {o.block_tokens // 2})" if layout == "zigzag" else ""
        return [
            f"ring overlap ({o.link}, {o.link_bytes_per_second / 1e9:g} GB/s one way, "
            f"{o.peak_flops / 1e12:g} TFLOP/s)",
            f"  threshold block   {o.threshold_tokens} tokens (forward "
            f"{math.ceil(o.forward_threshold_tokens)}, backward "
            f"{math.ceil(o.backward_threshold_tokens)}: c >= F/B x constant)",
            f"  this job's block  {o.block_tokens} tokens per rank{chunks}: communication "
            + ("hidden" if o.hidden else "exposed"),
            f"  forward step      {o.forward_compute_seconds * 1e3:.3g} ms compute at peak, "
            f"{o.forward_transfer_seconds * 1e3:.3g} ms transfer (one layer)",
        ]


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
    still the best choice, with communication exposed. None when no cp fits."""
    fitting = [cp for cp in _candidate_cps(inputs, cluster, layout)
               if memory_breakdown(inputs, cluster.accelerator, cp=cp).fits]
    hidden = [cp for cp in fitting if overlap_check(inputs, cluster, cp=cp).hidden]
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
    layout = inputs.layout if inputs.layout in ("zigzag", "striped") else "zigzag"
    return PlanReport(
        inputs=inputs, cluster=cluster, memory=memory, overlap=overlap_check(inputs, cluster),
        devices_needed=devices_needed, recommended_cp=recommend_cp(inputs, cluster, layout),
        recommended_layout=layout, layout_note=_layout_note(inputs.layout, inputs.cp),
        fits=not reasons, reasons=tuple(reasons),
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
