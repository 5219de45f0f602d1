"""``ringray bench ring --ulysses U``: a ring of world / U ranks × Ulysses groups of U, run end
to end, reporting the all-to-all seconds beside the ring's figures; one-line errors for a
degree that does not fit the world or the heads."""

from __future__ import annotations

import json

import pytest
from bench_rows import assert_summary_follows_from_the_ranks
from typer.testing import CliRunner

from ringray.cli import app

SMALL = ["--seq", "256", "--heads", "4", "--kv-heads", "1", "--head-dim", "16", "--iters", "1"]


def test_bench_ring_with_ulysses_reports_the_all_to_alls():
    result = CliRunner().invoke(app, ["bench", "ring", "--world", "4", "--ulysses", "2",
                                      "--layouts", "zigzag,contiguous", *SMALL, "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["layout"]: r for r in json.loads(result.stdout)}
    assert list(rows) == ["zigzag", "contiguous"]
    for row in rows.values():
        assert (row["ulysses"], row["ring_size"]) == (2, 2)
        assert len(row["a2a_seconds"]) == 4 and min(row["a2a_seconds"]) > 0
        assert row["a2a_seconds_max"] == max(row["a2a_seconds"])
        assert len(row["a2a_transfer_seconds"]) == 4 and min(row["a2a_transfer_seconds"]) > 0
        # q/k/v (4 + 2 + 2 heads: the one kv head repeated) and the output (4 heads), forward
        # and backward, 64 positions each, float32, head_dim 16; half of each buffer leaves.
        assert row["a2a_bytes_sent_per_rank"] == 2 * (8 + 4) * 64 * 16 * 4 // 2
        assert_summary_follows_from_the_ranks(row, ranks=4)
        # The ring's exposed time splits; the overlap leaves the peer wait out.
        assert 0.0 <= row["overlap_ratio"] <= 1.0
        assert len(row["peer_wait_seconds"]) == 4 and min(row["peer_wait_seconds"]) >= 0
        assert all(0.0 <= n <= t for n, t in zip(row["transfer_exposed_seconds"],
                                                  row["transfer_seconds"], strict=True))
    # The theory is the ring's over 2 members: contiguous's second half sees 129..256 keys
    # per query (24640 pairs) against a mean of 256 * 257 / 4 = 16448.
    assert rows["zigzag"]["imbalance_theoretical"] == 1.0
    assert rows["contiguous"]["imbalance_theoretical"] == pytest.approx(24640 / 16448)


def test_bench_ring_with_ulysses_prints_tables():
    result = CliRunner().invoke(app, ["bench", "ring", "--world", "2", "--ulysses", "2",
                                      "--layouts", "striped", *SMALL])
    assert result.exit_code == 0, result.output
    assert "layout: striped (ring 1 x ulysses 2)" in result.output
    assert "a2a s" in result.output and "ring exp. s" in result.output
    assert "ring peer wait s" in result.output and "peer wait s" in result.output
    assert "SDPA s" in result.output  # the summary's last column, not cut short


@pytest.mark.parametrize(("flags", "message"), [
    (["--world", "4", "--ulysses", "3"], "--ulysses: 3 must divide --world 4"),
    (["--world", "4", "--ulysses", "4", "--heads", "6", "--kv-heads", "2"],
     "--heads: 6 query heads do not split over ulysses=4 ranks"),
    (["--world", "4", "--ulysses", "2", "--heads", "6", "--kv-heads", "3"],
     "--kv-heads: 3 kv heads neither split over nor replicate evenly onto ulysses=2 ranks"),
    (["--world", "4", "--ulysses", "2", "--seq", "18"],
     "--seq: seq_len=18 cannot be split by layout 'zigzag' over 2 ring ranks x ulysses=2"),
])
def test_bad_ulysses_flags_fail_with_one_line(flags, message):
    result = CliRunner().invoke(app, ["bench", "ring", *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
