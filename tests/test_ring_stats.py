"""Every ring call records compute, exposed-communication and bytes for each step, and splits
each step's exposed wait into transfer not hidden (never more than the transfer's own time, so
overlap stays in [0, 1]) and waiting for a late peer."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict

import pytest
import torch
from distributed import run_gloo_ranks

from ringray.attention import RingStats, make_layout, ring_attention
from ringray.attention.comm import RingComm, ring_transfer_seconds
from ringray.attention.stats import (
    CudaIntervalTimer,
    CudaStepTimer,
    IntervalTimer,
    StepTimer,
    interval_timer,
    overlap_ratio,
    split_exposed,
)


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
        "calls": [asdict(c) for c in stats.calls],
        "skipped": stats.totals().transfers_skipped,
    }


def test_stats_record_every_step_with_the_bytes_sent():
    """Zigzag without documents over 3 ranks: rank 0 holds chunks 0 and 5 of 6, and every
    rank reads some rows of every block. Forward: rank 0's own block goes to ranks 1 and 2,
    who see only its chunk 0 (chunk 5 comes after all their queries): half the block each.
    Backward: the block received last is kept from the forward, so one K/V message goes out
    (half a block again), then the two dK/dV sums go back to their owners whole (rank 0's
    chunk-5 queries see all of ranks 1 and 2's keys). Against the plain ring's four backward
    messages, one (a K/V block) is skipped; the bytes skipped are the plain ring's less
    what was sent."""
    world = 3
    result = run_gloo_ranks(world, record_steps, timeout_seconds=90)[0]
    assert result["phases"] == [("forward", s) for s in range(3)] + [
        ("backward", s) for s in range(3)
    ]
    kv_bytes = 2 * 1 * (48 // world) * 4 * 16 * 4  # K and V, float32
    dkv_bytes = kv_bytes  # float32 gradient partial sums
    half = kv_bytes // 2
    assert result["bytes"] == [half, half, 0, half, dkv_bytes, dkv_bytes]
    assert result["finite"] and result["forward"] == 3 and result["plain_ok"]
    assert result["calls"] == [
        {"phase": "forward", "transfers": 2, "transfers_skipped": 0,
         "bytes_sent": 2 * half, "bytes_skipped": 2 * kv_bytes - 2 * half},
        {"phase": "backward", "transfers": 3, "transfers_skipped": 1,
         "bytes_sent": half + 2 * dkv_bytes,
         "bytes_skipped": 2 * kv_bytes + 2 * dkv_bytes - half - 2 * dkv_bytes},
    ]
    assert result["skipped"] == 1


# ---------------------------------------------------------------- the split, by hand
@pytest.mark.parametrize(("exposed", "window", "transfer", "not_hidden", "peer_wait"), [
    (0.3, 0.1, 0.5, 0.3, 0.0),  # the transfer ran past the compute: all of the wait is it
    (2.0, 0.1, 0.5, 0.4, 1.6),  # at most 0.5 - 0.1 after the compute; the rest, a late peer
    (0.7, 0.9, 0.5, 0.0, 0.7),  # the compute outlasted the transfer: any wait is a late peer
    (0.0, 0.0, 0.5, 0.0, 0.0),  # hidden (or the compute was instant and the wait nil)
    (0.2, 0.0, 0.0, 0.0, 0.2),  # nothing sent: a wait is for the peer
])
def test_split_exposed_hand_arithmetic(exposed, window, transfer, not_hidden, peer_wait):
    assert split_exposed(exposed, window, transfer) == pytest.approx((not_hidden, peer_wait),
                                                                     abs=1e-12)


def test_split_parts_are_bounded_and_sum_to_the_wait():
    """Over a grid of waits, windows and transfers: both parts ≥ 0, they sum to the wait,
    the unhidden part is at most the transfer, so 0 ≤ overlap ≤ 1."""
    values = (0.0, 1e-6, 0.01, 0.1, 0.5, 1.0, 3.0)
    for exposed, window, transfer in itertools.product(values, repeat=3):
        not_hidden, peer = split_exposed(exposed, window, transfer)
        assert not_hidden >= 0 and peer >= 0
        assert not_hidden + peer == pytest.approx(exposed, abs=1e-12)
        assert not_hidden <= transfer
        assert 0.0 <= overlap_ratio(not_hidden, transfer) <= 1.0


def test_cpu_step_timer_reads_the_window_and_the_wait_on_the_wall_clock():
    """A step that sleeps 50 ms "computing" (no CPU time) and 150 ms waiting: the window and
    the wait are wall time, compute is CPU time. Against a 100 ms transfer the wait splits
    into the 50 ms the transfer outlasted the compute and 100 ms of a late peer."""
    stats = RingStats()
    timer = stats.timer(torch.device("cpu"))
    assert type(timer) is StepTimer
    timer.start_compute()
    time.sleep(0.05)
    timer.end_compute()
    time.sleep(0.15)
    timer.end_wait()
    stats.add("forward", 0, timer, 1000)
    (record,) = stats.records
    assert record.compute_seconds < 0.02  # sleeping is not CPU time
    assert 0.05 <= record.overlap_window_seconds < 0.1
    assert 0.15 <= record.exposed_comm_seconds < 0.25
    totals = stats.totals(transfer_seconds_per_byte=1e-4)  # 1000 bytes: 0.1 s alone
    assert totals.transfer_seconds == pytest.approx(0.1)
    assert totals.transfer_exposed_seconds == pytest.approx(
        0.1 - record.overlap_window_seconds, abs=1e-12)
    assert totals.peer_wait_seconds == pytest.approx(
        record.exposed_comm_seconds - totals.transfer_exposed_seconds, abs=1e-12)
    assert totals.exposed_comm_seconds == pytest.approx(
        totals.transfer_exposed_seconds + totals.peer_wait_seconds, abs=1e-12)
    # Without a standalone rate nothing can be split: the wait all counts as unhidden.
    unsplit = stats.totals()
    assert unsplit.transfer_exposed_seconds == unsplit.exposed_comm_seconds
    assert unsplit.peer_wait_seconds == 0.0 and unsplit.transfer_seconds == 0.0


def test_the_standalone_transfer_is_timed_on_the_ring_waits_clock():
    """One clock for both sides: on CPU the baseline's timer is the wall clock, like the
    ring's waits (a CUDA device gets CUDA events for both: see the gpu test below)."""
    timer = interval_timer(torch.device("cpu"))
    assert type(timer) is IntervalTimer
    timer.start()
    time.sleep(0.05)
    timer.stop()
    assert 0.05 <= timer.seconds() < 0.1


@pytest.mark.gpu
def test_cuda_timers_read_the_window_and_the_wait_on_one_stream():
    """On CUDA both the ring's step timer and the baseline's interval timer are CUDA events
    on the current stream: a stream that spins ~20 ms "computing" and ~20 ms "waiting"
    reads both on that stream, and the window is the compute."""
    device = torch.device("cuda")
    assert type(interval_timer(device)) is CudaIntervalTimer
    timer = RingStats().timer(device)
    assert type(timer) is CudaStepTimer
    cycles = 20_000_000  # ~10-20 ms on current GPUs
    timer.start_compute()
    torch.cuda._sleep(cycles)
    timer.end_compute()
    torch.cuda._sleep(cycles)
    timer.end_wait()
    compute, window, exposed = timer.seconds()
    assert compute == window and compute > 1e-3 and exposed > 1e-3
    assert exposed == pytest.approx(compute, rel=0.5)


# ---------------------------------------------------------------- a real late peer
LATE_SECONDS = 0.4


def late_peer(rank: int, world: int) -> dict:
    """Rank 1 sleeps between its forward and its backward, so rank 0's first backward
    exchange waits for it; the standalone rate is measured first, as the trainer does."""
    torch.manual_seed(0)
    layout = make_layout("zigzag", world, 64)
    q, k, v = (layout.shard(torch.randn(1, 64, 2, 16), rank).requires_grad_() for _ in range(3))
    comm = RingComm()
    rates = []
    for _ in range(3):
        seconds, nbytes = ring_transfer_seconds(comm, k.detach())
        rates.append(seconds / nbytes)
    rate = statistics.median(rates)
    ring_attention(q, k, v, layout=layout).sum().backward()  # warm up
    stats = RingStats()
    out = ring_attention(q, k, v, layout=layout, stats=stats)
    if rank == 1:
        time.sleep(LATE_SECONDS)
    out.sum().backward()
    backward = stats.totals("backward", transfer_seconds_per_byte=rate)
    everything = stats.totals(transfer_seconds_per_byte=rate)
    return {
        "exposed": backward.exposed_comm_seconds,
        "not_hidden": backward.transfer_exposed_seconds,
        "peer_wait": backward.peer_wait_seconds,
        "transfer": backward.transfer_seconds,
        "overlap": overlap_ratio(everything.transfer_exposed_seconds,
                                 everything.transfer_seconds),
        "old_overlap": overlap_ratio(everything.exposed_comm_seconds,
                                     everything.transfer_seconds),
        "sum_ok": abs(everything.exposed_comm_seconds - everything.transfer_exposed_seconds
                      - everything.peer_wait_seconds) < 1e-9,
    }


def test_a_late_peer_is_peer_wait_not_unhidden_transfer():
    """Two gloo ranks; rank 1 is 0.4 s late for its backward. Rank 0 waits for it in its
    first backward exchange: that wait is peer wait (≥ half the lateness), its unhidden
    transfer stays within the transfers' own time, and its overlap stays in [0, 1] where
    the old ``1 - exposed / transfer`` goes far below 0. The late rank itself waits for no
    one."""
    punctual, late = run_gloo_ranks(2, late_peer, timeout_seconds=90)
    assert punctual["peer_wait"] >= 0.5 * LATE_SECONDS, punctual
    assert punctual["not_hidden"] <= punctual["transfer"], punctual
    assert 0.0 <= punctual["overlap"] <= 1.0 and punctual["old_overlap"] < -1.0, punctual
    assert late["peer_wait"] < 0.25 * LATE_SECONDS, late
    assert 0.0 <= late["overlap"] <= 1.0, late
    assert punctual["sum_ok"] and late["sum_ok"]


def both_transfer_modes(rank: int, world: int) -> dict:
    """The same call with ``transfers="mask"`` and ``"all"`` on the ``whole`` layout over
    packed documents (a length-1 document included): outputs, LSE and gradients, and the
    bytes each mode sent."""
    documents = [1, 17, 30, 5, 19]  # 72 tokens
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 72, heads, 16) for heads in (4, 2, 2))
    dout = torch.randn(1, 72, 4, 16)
    layout = make_layout("whole", world, 72, documents=documents)
    result = {}
    for mode in ("mask", "all"):
        leaves = [layout.shard(t, rank).clone().requires_grad_() for t in (q, k, v)]
        stats = RingStats()
        out, lse = ring_attention(*leaves, layout=layout, documents=documents, stats=stats,
                                  return_lse=True, transfers=mode)
        out.backward(layout.shard(dout, rank))
        result[mode] = {"out": out.detach(), "lse": lse, "grads": [t.grad for t in leaves],
                        "bytes": [c.bytes_sent for c in stats.calls],
                        "transfers": [c.transfers for c in stats.calls]}
    try:
        ring_attention(*(layout.shard(t, rank) for t in (q, k, v)), layout=layout,
                       documents=documents, transfers="some")
    except ValueError as exc:
        result["error"] = str(exc)
    return result


def test_transfers_all_is_the_plain_rings_traffic_with_the_same_result():
    """``transfers="all"`` (the baseline ``ringray bench ring --transfers all`` runs beside
    ringray's plan) sends every block whole to every rank: N - 1 K/V blocks forward, N - 2
    K/V blocks and N - 1 dK/dV sums backward per rank (the backward keeps the block the
    forward received last), float32; and gives bit-identical outputs, LSE and gradients to
    the default, which sends less. A bad mode is one line naming the argument."""
    world = 3
    results = run_gloo_ranks(world, both_transfer_modes, timeout_seconds=120)
    kv_block = 2 * 1 * (72 // world) * 2 * 16 * 4
    for rank, result in enumerate(results):
        mask, every = result["mask"], result["all"]
        assert torch.equal(mask["out"], every["out"]) and torch.equal(mask["lse"], every["lse"])
        assert all(torch.equal(a, b) for a, b in zip(mask["grads"], every["grads"], strict=True))
        assert every["bytes"] == [2 * kv_block, kv_block + 2 * kv_block], rank
        assert every["transfers"] == [2, 3]
        assert sum(mask["bytes"]) < sum(every["bytes"]), rank
        assert result["error"].startswith("transfers: expected 'mask' (only what a reader's "
                                          "queries see) or 'all'"), result["error"]
