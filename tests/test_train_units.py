"""Pure pieces of the trainer: mesh shape arithmetic, the learning-rate schedule, and the
per-step statistics computed from the ranks' reports (all checked against hand arithmetic,
no processes)."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from ringray.train.mesh import MeshShape, build_mesh, resolve_mesh_shape
from ringray.train.schedule import learning_rate
from ringray.train.step_stats import REPORT_FIELDS, summarize_step

# ---------------------------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "dp", "cp", "want"),
    [
        (8, 2, None, (2, 4)),  # cp inferred
        (8, None, 4, (2, 4)),  # dp inferred
        (6, 3, 2, (3, 2)),  # both given and consistent
        (4, None, None, (1, 4)),  # neither: dp = 1, all ranks in one ring
        (1, None, None, (1, 1)),
        (5, 5, None, (5, 1)),
    ],
)
def test_resolve_mesh_shape(world_size: int, dp: int | None, cp: int | None, want: tuple) -> None:
    shape = resolve_mesh_shape(world_size=world_size, dp=dp, cp=cp)
    assert (shape.dp, shape.cp) == want
    assert shape.world_size == world_size


@pytest.mark.parametrize(
    ("world_size", "dp", "cp", "needle"),
    [
        (6, 2, 2, "parallel: dp × cp must equal the world size: 2 × 2 = 4, but the world has 6"),
        (4, 2, 3, "2 × 3 = 6, but the world has 4"),
        (6, 4, None, "parallel.cp: cannot infer cp = world size / dp = 6 / 4"),
        (6, None, 4, "parallel.dp: cannot infer dp = world size / cp = 6 / 4"),
        (4, 0, None, "parallel.dp: must be >= 1, got 0"),
        (4, None, -2, "parallel.cp: must be >= 1, got -2"),
    ],
)
def test_resolve_mesh_shape_errors_show_the_arithmetic(
    world_size: int, dp: int | None, cp: int | None, needle: str
) -> None:
    """An inconsistent mesh names the degree and shows the product or division that fails."""
    with pytest.raises(ValueError) as info:
        resolve_mesh_shape(world_size=world_size, dp=dp, cp=cp)
    assert needle in str(info.value)


def test_mesh_coords_are_row_major() -> None:
    """Rank r sits at (r // cp, r % cp): a row of consecutive ranks is one CP ring."""
    shape = MeshShape(dp=2, cp=3)
    assert [shape.coords(r) for r in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2),
    ]


def test_build_mesh_single_process() -> None:
    """Without torch.distributed a 1-rank mesh is built with no groups; a larger one is an
    error that names the product and what is missing."""
    assert not dist.is_initialized()
    mesh = build_mesh(MeshShape(dp=1, cp=1))
    assert (mesh.rank, mesh.dp_rank, mesh.cp_rank) == (0, 0, 0)
    assert mesh.cp_group is None and mesh.dp_group is None
    assert not mesh.distributed
    with pytest.raises(ValueError, match=r"dp × cp = 4 needs torch.distributed"):
        build_mesh(MeshShape(dp=2, cp=2))


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule
# ---------------------------------------------------------------------------------------------

SCHEDULE = {"lr": 2.0, "warmup_steps": 4, "total_steps": 20, "min_lr_ratio": 0.1}


def test_warmup_is_linear_and_reaches_lr() -> None:
    """Step s < warmup gets lr * (s + 1) / warmup: the last warmup step trains at full lr."""
    got = [learning_rate(s, **SCHEDULE) for s in range(4)]
    assert got == pytest.approx([0.5, 1.0, 1.5, 2.0], rel=1e-12)
    assert learning_rate(4, **SCHEDULE) == pytest.approx(2.0, rel=1e-12)  # cosine starts at lr


def test_cosine_decay_points() -> None:
    """Cosine from lr at the end of warmup to min_lr_ratio * lr at total_steps (and held
    there after): halfway it is lr * (r + (1 - r) / 2); a quarter of the way,
    lr * (r + (1 - r) (1 + 1/sqrt 2) / 2)."""
    r, lr = 0.1, 2.0
    assert learning_rate(12, **SCHEDULE) == pytest.approx(lr * (r + (1 - r) * 0.5), rel=1e-12)
    quarter = lr * (r + (1 - r) * (1 + 1 / math.sqrt(2)) / 2)
    assert learning_rate(8, **SCHEDULE) == pytest.approx(quarter, rel=1e-12)
    assert learning_rate(20, **SCHEDULE) == pytest.approx(0.2, rel=1e-12)
    assert learning_rate(25, **SCHEDULE) == pytest.approx(0.2, rel=1e-12)


def test_monotone_after_warmup() -> None:
    lrs = [learning_rate(s, **SCHEDULE) for s in range(3, 30)]
    assert all(later <= earlier for earlier, later in zip(lrs, lrs[1:], strict=False))
    assert min(lrs) == pytest.approx(0.2, rel=1e-12)


def test_no_warmup() -> None:
    """warmup_steps=0: the first step trains at lr (no division by zero), then decays."""
    schedule = {**SCHEDULE, "warmup_steps": 0}
    assert learning_rate(0, **schedule) == pytest.approx(2.0, rel=1e-12)
    assert learning_rate(10, **schedule) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5), rel=1e-12)
    assert learning_rate(20, **schedule) == pytest.approx(0.2, rel=1e-12)


def test_warmup_as_long_as_training() -> None:
    """total_steps == warmup_steps: every step is warmup, the last at full lr (and a step
    past the end does not divide by zero)."""
    schedule = {**SCHEDULE, "warmup_steps": 20}
    assert learning_rate(0, **schedule) == pytest.approx(0.1, rel=1e-12)
    assert learning_rate(19, **schedule) == pytest.approx(2.0, rel=1e-12)
    assert learning_rate(25, **schedule) == pytest.approx(0.2, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Step statistics
# ---------------------------------------------------------------------------------------------


def report(
    *, loss_sum: float, compute: float, exposed: float, sent: float, seconds_per_byte: float,
    peak_memory: float, a2a: float = 0.0, peer_wait: float = 0.0, skipped: float = 0.0,
) -> list[float]:
    """One rank's row; ``exposed`` is the transfer not hidden, ``peer_wait`` comes on top."""
    row = {
        "loss_sum": loss_sum,
        "attention_compute_seconds": compute,
        "exposed_comm_seconds": exposed + peer_wait,
        "ring_bytes_sent": sent,
        "ring_transfer_seconds": sent * seconds_per_byte,
        "transfer_exposed_seconds": exposed,
        "peer_wait_seconds": peer_wait,
        "peak_memory_bytes": peak_memory,
        "a2a_seconds": a2a,
        "ring_transfers_skipped": skipped,
        "ring_bytes_skipped": skipped * 100,
    }
    assert tuple(row) == REPORT_FIELDS
    return list(row.values())


# dp = 2 × cp = 2: ranks 0, 1 form CP ring 0 and ranks 2, 3 ring 1.
#   transfer seconds = bytes × seconds/byte: 1.0, 1.0, 1.0, 0.5
#   overlap = 1 - not hidden / transfer:     0.9, 0.5, 1.0, 0.4 -> worst 0.4 (rank 3)
#   peer wait (not in the overlap):          0,   2.0, 0.5, 0   -> max 2.0 (rank 1)
#   imbalance per ring, max / mean:          ring 0 (1, 3) -> 1.5, ring 1 (2, 2) -> 1.0
#   (grouping by column instead, (1, 2) and (3, 2), would give 4/3 and 1.2)
REPORTS = [
    report(loss_sum=10, compute=1.0, exposed=0.1, sent=1000, seconds_per_byte=1e-3,
           peak_memory=100, a2a=0.25),
    report(loss_sum=20, compute=3.0, exposed=0.5, sent=1000, seconds_per_byte=1e-3,
           peak_memory=400, peer_wait=2.0),
    report(loss_sum=30, compute=2.0, exposed=0.0, sent=2000, seconds_per_byte=5e-4,
           peak_memory=300, peer_wait=0.5),
    report(loss_sum=40, compute=2.0, exposed=0.3, sent=500, seconds_per_byte=1e-3,
           peak_memory=200, skipped=3),
]
STEP = {
    "shape": MeshShape(dp=2, cp=2),
    "step": 7,
    "grad_norm": 0.75,
    "learning_rate": 1e-3,
    "step_seconds": 0.5,
    "tokens": 50,
    "flops_per_token": 1e9,
}


def test_summarize_step_hand_arithmetic() -> None:
    """loss = (10 + 20 + 30 + 40) / 50 tokens = 2; 100 tokens/s; MFU = 100 × 1e9 /
    (1e12 × 4 devices) = 0.025; overlap and imbalance as in the table above; peak memory is
    the largest rank's."""
    stats = summarize_step(REPORTS, **STEP, peak_flops_per_device=1e12)
    assert stats.loss == pytest.approx(2.0, rel=1e-12)
    assert stats.tokens_per_second == pytest.approx(100.0, rel=1e-12)
    assert stats.mfu == pytest.approx(0.025, rel=1e-12)
    assert stats.overlap_ratio == pytest.approx(0.4, rel=1e-12)
    assert stats.load_imbalance == pytest.approx(1.5, rel=1e-12)
    assert stats.peak_memory_bytes == 400 and isinstance(stats.peak_memory_bytes, int)
    assert stats.attention_compute_seconds == [1.0, 3.0, 2.0, 2.0]
    assert stats.exposed_comm_seconds == [0.1, 2.5, 0.5, 0.3]
    # The exposed wait's two parts, per rank; a late peer does not lower the overlap.
    assert stats.transfer_exposed_seconds == [0.1, 0.5, 0.0, 0.3]
    assert stats.peer_wait_seconds == [0.0, 2.0, 0.5, 0.0]
    assert stats.peer_wait_seconds_max == 2.0
    assert stats.ring_transfer_seconds == pytest.approx([1.0, 1.0, 1.0, 0.5], rel=1e-12)
    assert 0.0 <= stats.overlap_ratio <= 1.0
    assert (stats.step, stats.grad_norm, stats.learning_rate, stats.tokens) == (7, 0.75, 1e-3, 50)
    assert stats.to_dict()["mfu"] == stats.mfu
    # Per ring: overlap is the worse rank's (ring 0: min(0.9, 0.5), ring 1: min(1.0, 0.4)).
    assert stats.overlap_ratio_per_ring == pytest.approx([0.5, 0.4], rel=1e-12)
    assert stats.load_imbalance_per_ring == pytest.approx([1.5, 1.0], rel=1e-12)
    assert stats.ring_bytes_sent == [1000, 1000, 2000, 500]
    assert stats.ring_transfers_skipped == [0, 0, 0, 3]  # what the mask saved, per rank
    assert stats.ring_bytes_skipped == [0, 0, 0, 300]
    assert stats.peak_memory_bytes_per_rank == [100, 400, 300, 200]
    # Ulysses all-to-all seconds are reported per rank, apart from the ring's exposed time.
    assert stats.a2a_seconds == [0.25, 0.0, 0.0, 0.0]


def test_the_progress_line_shows_the_overlap_and_the_longest_peer_wait() -> None:
    from ringray.train.loop import format_step

    line = format_step(summarize_step(REPORTS, **STEP, peak_flops_per_device=1e12), 10)
    assert "overlap  0.400" in line and "peer wait  2.000s" in line


def test_summarize_step_without_peak_has_no_mfu() -> None:
    assert summarize_step(REPORTS, **STEP, peak_flops_per_device=None).mfu is None


def test_summarize_step_edge_cases() -> None:
    """No ring traffic counts as fully hidden; a rank that waited twice as long as its
    transfer takes (a slower peer) has its whole transfer unhidden, overlap 0, and the rest as
    peer wait, never a negative overlap; idle ranks are balanced; a zero-length step reports
    0 tokens/s rather than dividing by zero."""
    quiet = [
        report(loss_sum=1, compute=0.0, exposed=0.0, sent=0, seconds_per_byte=1e-3,
               peak_memory=1),
        report(loss_sum=1, compute=0.0, exposed=1.0, sent=1000, seconds_per_byte=1e-3,
               peak_memory=1, peer_wait=1.0),
    ]
    stats = summarize_step(
        quiet, **{**STEP, "shape": MeshShape(dp=1, cp=2), "step_seconds": 0.0, "tokens": 2},
        peak_flops_per_device=1e12,
    )
    assert stats.overlap_ratio == 0.0  # rank 1: 1 - 1 / 1
    assert stats.exposed_comm_seconds == [0.0, 2.0] and stats.peer_wait_seconds == [0.0, 1.0]
    assert stats.load_imbalance == 1.0
    assert stats.tokens_per_second == 0.0
    assert stats.mfu == 0.0
    assert stats.loss == pytest.approx(1.0, rel=1e-12)


def test_summarize_step_rejects_short_rows() -> None:
    with pytest.raises(ValueError):
        summarize_step([[1.0, 2.0]], **{**STEP, "shape": MeshShape(dp=1, cp=1)},
                       peak_flops_per_device=None)
