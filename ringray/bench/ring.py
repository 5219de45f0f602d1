"""``ringray bench ring``: overlap, load balance and work efficiency of ring attention.

Spawns N gloo processes on this machine (one torch thread each) and, per layout, runs
forward + backward of ``ring_attention`` on one global sequence, recording every ring step.
In the same run it measures, side by side:

- the standalone transfer time: the same sends and receives with no compute in between;
- one process running PyTorch SDPA forward + backward on the whole sequence (same threads).

Reported per layout:

- per-rank attention compute seconds (CPU seconds on CPU) and exposed communication seconds
  (time blocked waiting for a block after the step's compute), split per step
  (:func:`~ringray.attention.stats.split_exposed`, against the standalone transfer's rate)
  into ``transfer_exposed_seconds`` (transfer not hidden, at most the transfer's own time) and
  ``peer_wait_seconds`` (waiting for a late peer);
- ``overlap_ratio = 1 - transfer not hidden / standalone transfer`` for the worst rank, in
  [0, 1]; ``peer_wait_seconds_max``, the rank that waited longest for a peer;
- ``imbalance_measured`` (max ÷ mean per-rank compute) and ``imbalance_theoretical`` (max ÷
  mean query-key pairs of the layout under the causal mask); ``step_imbalance_theoretical``
  (the sum over ring steps of the slowest rank's pairs ÷ the mean rank's total,
  :func:`~ringray.attention.step_imbalance`: a ring step waits for its slowest rank, so a
  layout balanced in total but not per step shows up as exposed waiting);
- ``work_efficiency`` = sum of the ranks' compute ÷ the single-process SDPA compute
  (1.0 = the ring does no more work than one fused call on the whole sequence).

With packed documents (``documents="stdlib"``, ``"lognormal:MEAN[:SIGMA]"`` or ``"fixed:LEN"``, see
:func:`document_lengths`) attention is confined to each document, the theoretical imbalance
counts the pairs visible under the document mask
(:func:`~ringray.attention.document_work`), and the single-process ideal is one SDPA call
per document (forward + backward) on the whole sequence: the least work that computes the
same masked attention.

With ``ulysses=U`` (``--ulysses U``) the ``world`` ranks form a ring of R = world / U members
× Ulysses groups of U (:mod:`ringray.attention.ulysses`): each layout becomes the grid layout
``make_layout(name, world, seq, ulysses=U)``, every rank attends H/U heads over its ring
member's chunk, and the per-rank figures add the all-to-all seconds (all exposed: nothing
computes while one runs) beside the ring's exposed time. The standalone transfer and the
overlap are the ring's (its K/V block after the all-to-all: S/R positions, kv_heads / U heads
or one repeated head), and the theoretical imbalance is the ring layout's over R (the U ranks
of a group do equal work).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.table import Table

from ringray.attention import (
    RingStats,
    block_work,
    make_layout,
    ring_attention,
    step_imbalance,
)
from ringray.attention.comm import RingComm, ring_transfer_seconds
from ringray.attention.stats import imbalance_ratio, overlap_ratio
from ringray.attention.ulysses import (
    UlyssesComm,
    check_ulysses_heads,
    grid_groups,
    ulysses_transfer_seconds,
)
from ringray.attention.validation import TRANSFER_MODES
from ringray.bench.gloo_ranks import run_gloo_ranks

# The named document mixes live in ringray.data (the plan reads them too); kept here by name.
from ringray.data.mixes import DOCUMENT_SPECS as DOCUMENT_SPECS
from ringray.data.mixes import document_lengths as document_lengths


@dataclass(frozen=True)
class RingBenchConfig:
    world: int = 4
    seq: int = 16384
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    layouts: tuple[str, ...] = ("zigzag", "striped", "contiguous")
    causal: bool = True
    iters: int = 2
    warmup: int = 1
    dtype: str = "float32"
    batch: int = 1
    documents: str | None = None  # a document_lengths spec; None: one causal sequence
    ulysses: int = 1  # ranks per Ulysses group (head all-to-all); the ring has world / ulysses
    # ring_attention's transfers per layout, each run side by side: "mask" (only what a
    # reader reads) and/or "all" (every block whole to every rank: the plain ring's traffic)
    transfers: tuple[str, ...] = ("mask",)

    @property
    def runs(self) -> list[tuple[str, str]]:
        """(layout, transfers) pairs, in the order they run."""
        return [(name, mode) for name in self.layouts for mode in self.transfers]


@dataclass(frozen=True)
class RankResult:
    compute_seconds: float  # forward + backward, per iteration
    exposed_comm_seconds: float
    transfer_seconds: float  # the same exchanges with no compute
    bytes_sent: int
    a2a_seconds: float = 0.0  # the Ulysses all-to-alls, forward + backward (all exposed)
    a2a_bytes_sent: int = 0
    a2a_transfer_seconds: float = 0.0  # the same all-to-alls with no compute around them
    transfer_exposed_seconds: float = 0.0  # exposed_comm_seconds's transfer not hidden
    peer_wait_seconds: float = 0.0  # and its wait for a late peer
    wall_seconds: float = 0.0  # forward + backward by the wall clock, barrier to backward's end


@dataclass(frozen=True)
class LayoutResult:
    layout: str
    compute_seconds: list[float]
    exposed_comm_seconds: list[float]
    transfer_seconds: list[float]
    compute_seconds_max: float
    compute_seconds_mean: float
    exposed_comm_seconds_max: float
    overlap_ratio: float
    imbalance_measured: float
    imbalance_theoretical: float
    work_efficiency: float
    step_imbalance_theoretical: float
    single_process_seconds: float
    bytes_sent_per_rank: int  # the most any rank sent (ranks differ once masks skip sends)
    ulysses: int = 1
    ring_size: int = 0  # R: world / ulysses
    a2a_seconds: list[float] | None = None  # per rank, forward + backward
    a2a_seconds_max: float = 0.0
    a2a_bytes_sent_per_rank: int = 0
    a2a_transfer_seconds: list[float] | None = None  # per rank: the all-to-alls alone
    transfer_exposed_seconds: list[float] | None = None  # per rank: transfer not hidden
    peer_wait_seconds: list[float] | None = None  # per rank: waiting for a late peer
    peer_wait_seconds_max: float = 0.0
    transfers: str = "mask"  # ring_attention's transfers: "mask" or "all" (plain ring)
    wall_seconds_max: float = 0.0  # the slowest rank's forward + backward, wall clock


def _run_key(name: str, mode: str) -> str:
    return f"{name}|{mode}"


def _inputs(cfg: RingBenchConfig):
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, cfg.dtype)
    q = torch.randn(cfg.batch, cfg.seq, cfg.heads, cfg.head_dim, generator=g).to(dtype)
    k = torch.randn(cfg.batch, cfg.seq, cfg.kv_heads, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(cfg.batch, cfg.seq, cfg.kv_heads, cfg.head_dim, generator=g).to(dtype)
    dout = torch.randn(cfg.batch, cfg.seq, cfg.heads, cfg.head_dim, generator=g).to(dtype)
    return q, k, v, dout


def _single_process_seconds(cfg: RingBenchConfig, q, k, v, dout,
                            documents: list[int] | None) -> float:
    """CPU seconds of SDPA forward + backward on the whole sequence in one process: one call,
    or one call per document (median of runs)."""
    bounds = [0, *itertools.accumulate(documents or [cfg.seq])]
    runs = []
    for i in range(cfg.warmup + cfg.iters):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        start = time.process_time()
        out = torch.cat([
            F.scaled_dot_product_attention(
                qg[:, s:e].transpose(1, 2), kg[:, s:e].transpose(1, 2),
                vg[:, s:e].transpose(1, 2), is_causal=cfg.causal,
                enable_gqa=cfg.heads != cfg.kv_heads,
            )
            for s, e in itertools.pairwise(bounds)
        ], dim=2)
        out.backward(dout.transpose(1, 2))
        if i >= cfg.warmup:
            runs.append(time.process_time() - start)
    return statistics.median(runs)


def _rank_main(rank: int, world: int, cfg: RingBenchConfig) -> dict:
    q, k, v, dout = _inputs(cfg)
    documents = document_lengths(cfg.documents, cfg.seq) if cfg.documents else None
    single = None
    if rank == 0:
        single = _single_process_seconds(cfg, q, k, v, dout, documents)
    ring_group, ulysses_group = grid_groups(cfg.ulysses) if cfg.ulysses > 1 else (None, None)
    ring = RingComm(ring_group)
    # The ring's K block after the all-to-all: the member's S/R positions, H_kv/U heads (or
    # one repeated head); what the standalone transfer moves.
    k_ring = torch.empty(cfg.batch, cfg.seq // ring.world_size,
                         max(cfg.kv_heads // cfg.ulysses, 1), cfg.head_dim, dtype=q.dtype)
    dist.barrier()
    per_layout = {}
    for name, mode in cfg.runs:
        layout = make_layout(name, world, cfg.seq, documents=documents, ulysses=cfg.ulysses)
        q_l, k_l, v_l, dout_l = (layout.shard(t, rank) for t in (q, k, v, dout))
        rows = []
        for i in range(cfg.warmup + cfg.iters):
            stats = RingStats()
            qg, kg, vg = (t.clone().requires_grad_() for t in (q_l, k_l, v_l))
            dist.barrier()
            wall = time.perf_counter()
            out = ring_attention(qg, kg, vg, ring_group, ulysses_group=ulysses_group,
                                 layout=layout, causal=cfg.causal, stats=stats,
                                 documents=documents, transfers=mode)
            out.backward(dout_l)
            wall = time.perf_counter() - wall
            transfer, transfer_bytes = ring_transfer_seconds(ring, k_ring)
            totals = stats.totals(transfer_seconds_per_byte=(
                transfer / transfer_bytes if transfer_bytes else None))
            a2a_alone = (ulysses_transfer_seconds(UlyssesComm(ulysses_group), q_l, k_l, v_l)
                         if cfg.ulysses > 1 else 0.0)
            if i >= cfg.warmup:
                rows.append(RankResult(totals.compute_seconds, totals.exposed_comm_seconds,
                                       transfer, totals.bytes_sent, totals.a2a_seconds,
                                       totals.a2a_bytes_sent, a2a_alone,
                                       totals.transfer_exposed_seconds,
                                       totals.peer_wait_seconds, wall))
        per_layout[_run_key(name, mode)] = RankResult(
            compute_seconds=statistics.median(r.compute_seconds for r in rows),
            exposed_comm_seconds=statistics.median(r.exposed_comm_seconds for r in rows),
            transfer_seconds=statistics.median(r.transfer_seconds for r in rows),
            bytes_sent=rows[-1].bytes_sent,
            a2a_seconds=statistics.median(r.a2a_seconds for r in rows),
            a2a_bytes_sent=rows[-1].a2a_bytes_sent,
            a2a_transfer_seconds=statistics.median(r.a2a_transfer_seconds for r in rows),
            # Medians of parts each ≤ its iteration's transfer stay ≤ the transfer's median.
            transfer_exposed_seconds=statistics.median(r.transfer_exposed_seconds
                                                       for r in rows),
            peer_wait_seconds=statistics.median(r.peer_wait_seconds for r in rows),
            wall_seconds=statistics.median(r.wall_seconds for r in rows),
        )
    return {"single": single, "layouts": {n: asdict(r) for n, r in per_layout.items()}}


def summarize(cfg: RingBenchConfig, per_rank: list[dict]) -> list[LayoutResult]:
    single = per_rank[0]["single"]
    documents = document_lengths(cfg.documents, cfg.seq) if cfg.documents else None
    results = []
    for name, mode in cfg.runs:
        ranks = [RankResult(**r["layouts"][_run_key(name, mode)]) for r in per_rank]
        compute = [r.compute_seconds for r in ranks]
        exposed = [r.exposed_comm_seconds for r in ranks]
        transfer = [r.transfer_seconds for r in ranks]
        a2a = [r.a2a_seconds for r in ranks]
        not_hidden = [r.transfer_exposed_seconds for r in ranks]
        peer_wait = [r.peer_wait_seconds for r in ranks]
        layout = make_layout(name, cfg.world, cfg.seq, documents=documents,
                             ulysses=cfg.ulysses)
        pairs = block_work(layout.ring, documents, causal=cfg.causal)  # a group's ranks: equal
        work = [sum(row) for row in pairs]
        theoretical = max(work) / statistics.mean(work)
        overlap = min(overlap_ratio(e, t) for e, t in zip(not_hidden, transfer, strict=True))
        results.append(
            LayoutResult(
                layout=name,
                compute_seconds=compute,
                exposed_comm_seconds=exposed,
                transfer_seconds=transfer,
                compute_seconds_max=max(compute),
                compute_seconds_mean=statistics.mean(compute),
                exposed_comm_seconds_max=max(exposed),
                overlap_ratio=overlap,
                imbalance_measured=imbalance_ratio(compute),
                imbalance_theoretical=theoretical,
                work_efficiency=sum(compute) / single,
                step_imbalance_theoretical=step_imbalance(pairs),
                single_process_seconds=single,
                bytes_sent_per_rank=max(r.bytes_sent for r in ranks),
                ulysses=cfg.ulysses,
                ring_size=cfg.world // cfg.ulysses,
                a2a_seconds=a2a,
                a2a_seconds_max=max(a2a),
                a2a_bytes_sent_per_rank=ranks[0].a2a_bytes_sent,
                a2a_transfer_seconds=[r.a2a_transfer_seconds for r in ranks],
                transfer_exposed_seconds=not_hidden,
                peer_wait_seconds=peer_wait,
                peer_wait_seconds_max=max(peer_wait),
                transfers=mode,
                wall_seconds_max=max(r.wall_seconds for r in ranks),
            )
        )
    return results


def run_ring_bench(cfg: RingBenchConfig) -> list[LayoutResult]:
    """Run the benchmark on ``cfg.world`` local gloo processes and summarise it."""
    documents = document_lengths(cfg.documents, cfg.seq) if cfg.documents else None
    for name in cfg.layouts:  # a bad --seq, layout or documents spec fails here, not in a rank
        make_layout(name, cfg.world, cfg.seq, documents=documents, ulysses=cfg.ulysses)
    if cfg.ulysses > 1:
        check_ulysses_heads(cfg.heads, cfg.kv_heads, cfg.ulysses)
    bad = [mode for mode in cfg.transfers if mode not in TRANSFER_MODES]
    if bad or not cfg.transfers:
        raise ValueError(f"transfers: {', '.join(bad) or 'none given'}; valid: "
                         f"{', '.join(TRANSFER_MODES)}")
    per_rank = run_gloo_ranks(cfg.world, _rank_main, cfg, timeout_seconds=3600)
    return summarize(cfg, per_rank)


def ulysses_tables(results: list[LayoutResult]) -> list[Table]:
    """A run with Ulysses as tables: per layout, each rank's ring compute, the ring's exposed
    communication and its overlap, the all-to-alls' seconds and the same all-to-alls alone
    (the difference is waiting for the group's slowest rank); then a summary."""
    tables = []
    for r in results:
        table = Table(title=f"layout: {r.layout} (ring {r.ring_size} x ulysses {r.ulysses})",
                      title_justify="left")
        for col in ("rank", "ring, ulysses", "compute s", "ring exposed s", "ring peer wait s",
                    "ring alone s", "ring overlap", "a2a s", "a2a alone s"):
            table.add_column(col, justify="right")
        for rank, (c, e, n, w, t, a, alone) in enumerate(zip(
            r.compute_seconds, r.exposed_comm_seconds, r.transfer_exposed_seconds or [],
            r.peer_wait_seconds or [], r.transfer_seconds, r.a2a_seconds or [],
            r.a2a_transfer_seconds or [], strict=True,
        )):
            ring_index, ulysses_index = divmod(rank, r.ulysses)
            table.add_row(str(rank), f"{ring_index}, {ulysses_index}", f"{c:.3f}", f"{e:.4f}",
                          f"{w:.4f}", f"{t:.4f}", f"{overlap_ratio(n, t):.3f}", f"{a:.4f}",
                          f"{alone:.4f}")
        tables.append(table)
    summary = Table(title="summary (compute = CPU seconds, forward + backward; a2a = wall "
                    "seconds of the all-to-alls, all exposed; overlap = the ring's, without "
                    "its peer wait; imbalance "
                    "= max/mean; work eff. = ranks' compute / 1-process SDPA)",
                    title_justify="left")
    for col in ("layout", "overlap", "imbal.", "imbal. theory", "work eff.", "max s",
                "ring exp. s", "peer wait s", "a2a s", "a2a MiB", "ring MiB", "SDPA s"):
        summary.add_column(col, justify="right", no_wrap=True)
    for r in results:
        summary.add_row(
            r.layout, f"{r.overlap_ratio:.3f}", f"{r.imbalance_measured:.3f}",
            f"{r.imbalance_theoretical:.3f}", f"{r.work_efficiency:.3f}",
            f"{r.compute_seconds_max:.3f}", f"{r.exposed_comm_seconds_max:.4f}",
            f"{r.peer_wait_seconds_max:.4f}", f"{r.a2a_seconds_max:.4f}",
            f"{r.a2a_bytes_sent_per_rank / 2**20:.1f}",
            f"{r.bytes_sent_per_rank / 2**20:.1f}", f"{r.single_process_seconds:.3f}",
        )
    tables.append(summary)
    return tables
