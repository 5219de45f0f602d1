"""The plan of one job on one cluster: :func:`plan` (memory, overlap, the Ulysses options,
the recommended cp and layout, the verdict) and :class:`PlanReport`, which formats it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ringray.accelerators import GIB, ClusterShape, PlanError
from ringray.attention.layouts import seq_len_divisor
from ringray.capacity.fit import (
    MEMORY_RESERVE_RATIO,
    MemoryBreakdown,
    OverlapCheck,
    memory_breakdown,
    overlap_check,
)
from ringray.capacity.inputs import PlanInputs
from ringray.capacity.masked import MAX_WALKED_POSITIONS, MaskLine, RingShape, step_plan
from ringray.capacity.ulysses import (
    ULYSSES_RULE,
    UlyssesOption,
    a2a_link,
    recommend_ulysses,
    ulysses_options,
)
from ringray.model.loss import LOSS_CHUNK_TOKENS
from ringray.model.rope import describe_rope
from ringray.train import TrainOptions


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
    # The ring's real step plan under the job's masks (documents, windows): one line per
    # mask; empty when there is one causal document per sequence (the overlap rule is then
    # the plan), with ``step_plan_note`` saying why when it could not be walked.
    step_plan: tuple[MaskLine, ...] = ()
    step_plan_note: str = ""

    @property
    def job_ulysses(self) -> UlyssesOption | None:
        """The figures of the job's own ring × ulysses."""
        return next((option for option in self.ulysses_options
                     if option.ulysses == self.inputs.ulysses), None)

    @property
    def verdict(self) -> str:
        if self.fits:
            mem = self.memory
            return (f"fits: {mem.device_bytes / GIB:.1f} GiB of {mem.usable_bytes / GIB:.1f} "
                    f"GiB usable per device")
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
            "memory": {**asdict(self.memory), "static_bytes": self.memory.static_bytes,
                       "nccl_bytes": self.memory.comm.total_bytes,
                       "device_bytes": self.memory.device_bytes},
            "overlap": {**asdict(self.overlap), "threshold_tokens": self.overlap.threshold_tokens,
                        "hidden": self.overlap.hidden},
            "ulysses": [{**asdict(option), "exposed_seconds": option.exposed_seconds}
                        for option in self.ulysses_options],
            "step_plan": [{"mask": line.mask, "layers": line.layers,
                           "ringray": {**asdict(line.ringray),
                                       "bytes_fraction": line.ringray.bytes_fraction},
                           "plain_ring": asdict(line.plain)} for line in self.step_plan],
            "step_plan_note": self.step_plan_note,
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
            *self._step_plan_lines(),
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
            (f"loss chunk (<= {LOSS_CHUNK_TOKENS} tokens' logits)", m.loss_chunk_bytes),
            *([("FSDP gathered weights and gradients", m.gathered_bytes)] if shards > 1 else []),
            ("step transient (after backward)", m.step_transient_bytes),
            (f"peak (at the {m.peak_moment})", m.peak_bytes),
            *self._nccl_rows(),
            (f"usable ({acc.memory_bytes / GIB:g} GiB less {MEMORY_RESERVE_RATIO:.0%} reserve)",
             m.usable_bytes),
        ]
        return [f"{'memory per device':<46}{'GiB':>7}"] + [
            f"  {label:<44}{value / GIB:>7.2f}" for label, value in rows
        ]

    def _nccl_rows(self) -> list[tuple[str, int]]:
        """NCCL's buffers (outside PyTorch's allocator, :mod:`ringray.capacity.nccl`) and
        the device's total; none for a job that opens no NCCL connection of its own."""
        m, comm = self.memory, self.memory.comm
        rows = []
        if comm.ring_bytes:
            rows.append((f"NCCL ring P2P ({comm.ring_peers} peers x {comm.ring_channels} "
                         f"channels)", comm.ring_bytes))
        if comm.ulysses_bytes:
            rows.append((f"NCCL all-to-all ({comm.ulysses_peers} peers x "
                         f"{comm.ulysses_channels} channels)", comm.ulysses_bytes))
        if comm.fsdp_bytes:
            rows.append((f"NCCL FSDP communicator ({comm.fsdp_channels} channels)",
                         comm.fsdp_bytes))
        return [*rows, ("per device (peak + NCCL buffers)", m.device_bytes)] if rows else []

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

    def _step_plan_lines(self) -> list[str]:
        if self.step_plan_note:
            return [f"ring step plan: {self.step_plan_note}"]
        if not self.step_plan:
            return []
        i = self.inputs
        docs = (f", documents {i.documents_spec} ({len(i.documents)} in a sequence)"
                if i.documents is not None else "")
        lines = [f"ring step plan ({i.layout} layout{docs}; one layer, forward + backward, at "
                 f"peak; a projection from the plan the ring runs)"]
        for line in self.step_plan:
            r, p = line.ringray, line.plain
            lines.append(
                f"  {line.mask + ' (' + str(line.layers) + ' layers)':<26}{_ms(r.seconds)} ms, "
                f"{_ms(r.exposed_seconds)} ms exposed, {r.bytes_fraction:.0%} of the plain "
                f"ring's bytes (plain ring {_ms(p.seconds)} ms, {_ms(p.exposed_seconds)} ms "
                f"exposed)")
        return lines

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
        link, rate = a2a_link(self.cluster)
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
               if memory_breakdown(inputs, cluster, cp=cp, ulysses=1).fits]
    hidden = [cp for cp in fitting
              if overlap_check(inputs, cluster, cp=cp, ulysses=1).hidden]
    return (hidden or fitting or [None])[0]


def plan(inputs: PlanInputs, cluster: ClusterShape) -> PlanReport:
    """Memory, overlap, recommendation and verdict of ``inputs`` on ``cluster``."""
    memory = memory_breakdown(inputs, cluster)
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
        over = memory.device_bytes - memory.usable_bytes
        nccl = (f" (peak {memory.peak_bytes / GIB:.1f} + NCCL buffers "
                f"{memory.comm.total_bytes / GIB:.1f})" if memory.comm.total_bytes else "")
        reasons.append(
            f"{memory.device_bytes / GIB:.1f} GiB per device{nccl} is {over / GIB:.1f} GiB "
            f"over the {memory.usable_bytes / GIB:.1f} GiB usable: activations take "
            f"{memory.activations_bytes / GIB:.1f} GiB at {inputs.block_tokens} tokens per rank"
            f"{_remedies(inputs, cluster)}")
    grids = ulysses_options(inputs, cluster)
    own = next(option for option in grids if option.ulysses == inputs.ulysses)
    if own.refused is not None and not own.refused.startswith("peak"):  # memory: above
        reasons.append(f"parallel.ulysses: {inputs.ulysses} is not allowed here: "
                       f"{own.refused}")
    layout = inputs.layout if inputs.layout in ("zigzag", "striped") else "zigzag"
    lines, note = _step_plan(inputs, cluster)
    return PlanReport(
        inputs=inputs, cluster=cluster, memory=memory, overlap=overlap_check(inputs, cluster),
        devices_needed=devices_needed, recommended_cp=recommend_cp(inputs, cluster, layout),
        recommended_layout=layout, layout_note=_layout_note(inputs.layout, inputs.cp),
        fits=not reasons, reasons=tuple(reasons), ulysses_options=grids,
        recommended_ulysses=recommend_ulysses(grids), step_plan=lines, step_plan_note=note,
    )


def _step_plan(inputs: PlanInputs, cluster: ClusterShape) -> tuple[tuple[MaskLine, ...], str]:
    """The ring's step plan under the job's documents and windows, or a note saying why it
    is not walked (nothing masked: the overlap rule is the plan; too large to walk)."""
    cfg = inputs.model
    windows = [cfg.layer_window(layer) for layer in range(cfg.n_layers)]
    masked = inputs.documents is not None or any(w is not None for w in windows)
    if inputs.ring_size == 1:
        return (), ""
    if not masked:
        if inputs.packs_documents:
            return (), ("the job packs documents (data.documents); give --documents SPEC "
                        "(stdlib, lognormal:MEAN[:SIGMA] or fixed:LEN) to plan its steps by a mix")
        return (), ""
    if inputs.seq_len * inputs.ring_size > MAX_WALKED_POSITIONS:
        return (), (f"not walked: seq {inputs.seq_len} over a ring of {inputs.ring_size} is "
                    f"more than {MAX_WALKED_POSITIONS} positions to plan here")
    from ringray.attention.layouts import make_layout
    from ringray.train.footprint import kv_repeat

    documents = list(inputs.documents) if inputs.documents is not None else None
    layout = make_layout(inputs.layout, inputs.ring_size, inputs.seq_len, documents=documents)
    _, link_rate = cluster.ring_link(inputs.cp)
    u = inputs.ulysses
    shape = RingShape(q_heads=cfg.n_heads / u, kv_heads=cfg.n_kv_heads * kv_repeat(cfg, u) / u,
                      head_dim=cfg.head_dim, batch=inputs.local_batch,
                      kv_bytes=inputs.activation_dtype_bytes,
                      peak_flops=cluster.accelerator.peak_flops,
                      link_bytes_per_second=link_rate)
    return step_plan(layout, documents, windows, shape), ""


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
        peak = memory_breakdown(replace(inputs, **applied), cluster).device_bytes
        hints.append(f"{'+ ' if hints else ''}{label} {peak / GIB:.1f} GiB")
    return f"; lower peaks: {', '.join(hints)}" if hints else ""


def plan_job(options: TrainOptions, cluster: ClusterShape, *, name: str,
             documents: str | None = None) -> PlanReport:
    """:func:`plan` for a job's training options (``name``: the job's, for the report;
    ``documents``: a mix to plan the ring's steps by, ``stdlib``, ``lognormal:MEAN[:SIGMA]`` or
    ``fixed:LEN``)."""
    inputs = PlanInputs.from_options(options, cluster, name=name)
    if documents is not None:
        from ringray.data.mixes import document_lengths

        try:
            lengths = document_lengths(documents, inputs.seq_len)
        except ValueError as exc:
            raise PlanError(f"--documents: {str(exc).removeprefix('documents: ')}") from None
        layout = inputs.layout
        if not inputs.packs_documents and layout == "zigzag" and options.parallel.layout == \
                "auto":
            layout = "balanced"  # what auto runs once data.documents is on
        inputs = replace(inputs, documents=tuple(lengths), documents_spec=documents,
                         layout=layout)
    return plan(inputs, cluster)
