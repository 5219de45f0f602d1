"""Every ring call records compute, exposed-communication and bytes for each step."""

from __future__ import annotations

import torch
from distributed import run_gloo_ranks

from ringray.attention import RingStats, make_layout, ring_attention


def record_steps(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    layout = make_layout("zigzag", world, 48)
    q, k, v = (layout.shard(torch.randn(1, 48, 4, 16), rank).requires_grad_() for _ in range(3))
    stats = RingStats()
    ring_attention(q, k, v, layout=layout, stats=stats).sum().backward()
    records = stats.records
    plain = ring_attention(q, k, v, layout=layout)  # no stats object: nothing recorded
    return {
        "phases": [(r.phase, r.step) for r in records],
        "bytes": [r.bytes_sent for r in records],
        "finite": all(r.compute_seconds >= 0 and r.exposed_comm_seconds >= 0 for r in records),
        "forward": stats.totals("forward").steps,
        "plain_ok": plain.shape == q.shape,
    }


def test_stats_record_every_step_with_the_bytes_sent():
    world = 3
    result = run_gloo_ranks(world, record_steps, timeout_seconds=90)[0]
    assert result["phases"] == [("forward", s) for s in range(3)] + [
        ("backward", s) for s in range(3)
    ]
    kv_bytes = 2 * 1 * (48 // world) * 4 * 16 * 4  # K and V, float32
    dkv_bytes = kv_bytes  # float32 gradient partial sums
    assert result["bytes"] == [kv_bytes, kv_bytes, 0, kv_bytes, kv_bytes + dkv_bytes, dkv_bytes]
    assert result["finite"] and result["forward"] == 3 and result["plain_ok"]
