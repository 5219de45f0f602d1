"""``ringray bench ring``: overlap, load balance and work efficiency of ring attention.

Spawns N gloo processes on this machine (one torch thread each) and, per layout, runs
forward + backward of ``ring_attention`` on one global sequence, recording every ring step.
In the same run it measures, side by side:

- the standalone transfer time: the same sends and receives with no compute in between;
- one process running PyTorch SDPA forward + backward on the whole sequence (same threads).

Reported per layout:

- per-rank attention compute seconds (CPU seconds on CPU) and exposed communication seconds
  (time blocked waiting for a block after the step's compute);
- ``overlap_ratio = 1 - exposed / standalone transfer`` for the worst rank;
- ``imbalance_measured`` (max ÷ mean per-rank compute) and ``imbalance_theoretical`` (max ÷
  mean query-key pairs of the layout under the causal mask);
- ``work_efficiency`` = sum of the ranks' compute ÷ the single-process SDPA compute
  (1.0 = the ring does no more work than one fused call on the whole sequence).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringray.attention import RingStats, causal_work, make_layout, ring_attention
from ringray.attention.comm import RingComm, ring_transfer_seconds
from ringray.attention.stats import imbalance_ratio, overlap_ratio
from ringray.bench.gloo_ranks import run_gloo_ranks


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


@dataclass(frozen=True)
class RankResult:
    compute_seconds: float  # forward + backward, per iteration
    exposed_comm_seconds: float
    transfer_seconds: float  # the same exchanges with no compute
    bytes_sent: int


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
    single_process_seconds: float
    bytes_sent_per_rank: int


def _inputs(cfg: RingBenchConfig):
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, cfg.dtype)
    q = torch.randn(cfg.batch, cfg.seq, cfg.heads, cfg.head_dim, generator=g).to(dtype)
    k = torch.randn(cfg.batch, cfg.seq, cfg.kv_heads, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(cfg.batch, cfg.seq, cfg.kv_heads, cfg.head_dim, generator=g).to(dtype)
    dout = torch.randn(cfg.batch, cfg.seq, cfg.heads, cfg.head_dim, generator=g).to(dtype)
    return q, k, v, dout


def _single_process_seconds(cfg: RingBenchConfig, q, k, v, dout) -> float:
    """CPU seconds of one SDPA forward + backward on the whole sequence (median of runs)."""
    runs = []
    for i in range(cfg.warmup + cfg.iters):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        start = time.process_time()
        out = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
            is_causal=cfg.causal, enable_gqa=cfg.heads != cfg.kv_heads,
        )
        out.backward(dout.transpose(1, 2))
        if i >= cfg.warmup:
            runs.append(time.process_time() - start)
    return statistics.median(runs)


def _rank_main(rank: int, world: int, cfg: RingBenchConfig) -> dict:
    q, k, v, dout = _inputs(cfg)
    single = None
    if rank == 0:
        single = _single_process_seconds(cfg, q, k, v, dout)
    dist.barrier()
    per_layout = {}
    for name in cfg.layouts:
        layout = make_layout(name, world, cfg.seq)
        q_l, k_l, v_l, dout_l = (layout.shard(t, rank) for t in (q, k, v, dout))
        rows = []
        for i in range(cfg.warmup + cfg.iters):
            stats = RingStats()
            qg, kg, vg = (t.clone().requires_grad_() for t in (q_l, k_l, v_l))
            dist.barrier()
            out = ring_attention(qg, kg, vg, layout=layout, causal=cfg.causal, stats=stats)
            out.backward(dout_l)
            totals = stats.totals()
            transfer, _ = ring_transfer_seconds(RingComm(), k_l)
            if i >= cfg.warmup:
                rows.append(RankResult(totals.compute_seconds, totals.exposed_comm_seconds,
                                       transfer, totals.bytes_sent))
        per_layout[name] = RankResult(
            compute_seconds=statistics.median(r.compute_seconds for r in rows),
            exposed_comm_seconds=statistics.median(r.exposed_comm_seconds for r in rows),
            transfer_seconds=statistics.median(r.transfer_seconds for r in rows),
            bytes_sent=rows[-1].bytes_sent,
        )
    return {"single": single, "layouts": {n: asdict(r) for n, r in per_layout.items()}}


def summarize(cfg: RingBenchConfig, per_rank: list[dict]) -> list[LayoutResult]:
    single = per_rank[0]["single"]
    results = []
    for name in cfg.layouts:
        ranks = [RankResult(**r["layouts"][name]) for r in per_rank]
        compute = [r.compute_seconds for r in ranks]
        exposed = [r.exposed_comm_seconds for r in ranks]
        transfer = [r.transfer_seconds for r in ranks]
        if cfg.causal:
            work = causal_work(make_layout(name, cfg.world, cfg.seq))
            theoretical = max(work) / statistics.mean(work)
        else:
            theoretical = 1.0
        overlap = min(overlap_ratio(e, t) for e, t in zip(exposed, transfer, strict=True))
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
                single_process_seconds=single,
                bytes_sent_per_rank=ranks[0].bytes_sent,
            )
        )
    return results


def run_ring_bench(cfg: RingBenchConfig) -> list[LayoutResult]:
    """Run the benchmark on ``cfg.world`` local gloo processes and summarise it."""
    for name in cfg.layouts:
        make_layout(name, cfg.world, cfg.seq)  # a bad --seq or layout fails here, not in a rank
    per_rank = run_gloo_ranks(cfg.world, _rank_main, cfg, timeout_seconds=3600)
    return summarize(cfg, per_rank)
