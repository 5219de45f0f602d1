"""`ringray bench ring` runs end to end and reports the documented fields."""

from __future__ import annotations

import json

from bench_rows import assert_summary_follows_from_the_ranks
from typer.testing import CliRunner

from ringray.cli import app

KEYS = {
    "layout", "compute_seconds_max", "compute_seconds_mean", "exposed_comm_seconds_max",
    "overlap_ratio", "imbalance_measured", "imbalance_theoretical", "work_efficiency",
    "transfer_exposed_seconds", "peer_wait_seconds", "peer_wait_seconds_max",
}


def test_bench_ring_json_has_one_object_per_layout():
    result = CliRunner().invoke(app, [
        "bench", "ring", "--world", "2", "--seq", "512", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "32", "--layouts", "zigzag,contiguous", "--iters", "1", "--json",
    ])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["layout"] for r in rows] == ["zigzag", "contiguous"]
    # What a rank sends on a ring of 2: the rows of its K/V block (256 tokens x 2 kv heads x
    # 32 dims, float32, k and v) that the other rank reads, and the float32 dK/dV rows of
    # the other's block that it read back to their owner (the backward keeps the block it
    # received last, so sends none again). Zigzag: rank 0 holds chunks 0 and 3, rank 1
    # chunks 1 and 2, so rank 1 reads only chunk 0 of rank 0's block: each rank sends one
    # whole block and one half. Contiguous (causal): rank 0 reads nothing of rank 1, so
    # rank 0 sends its block and rank 1 its dK/dV sums: 1 block at most.
    kv_block_bytes = 256 * 2 * 32 * 4 * 2
    blocks = {"zigzag": 1.5, "contiguous": 1}
    for row in rows:
        assert KEYS <= row.keys()
        assert_summary_follows_from_the_ranks(row, ranks=2)
        assert row["bytes_sent_per_rank"] == blocks[row["layout"]] * kv_block_bytes
        # The exposed time splits into transfer not hidden and peer wait; overlap in [0, 1].
        assert 0.0 <= row["overlap_ratio"] <= 1.0
        for exposed, not_hidden, wait, alone in zip(
            row["exposed_comm_seconds"], row["transfer_exposed_seconds"],
            row["peer_wait_seconds"], row["transfer_seconds"], strict=True,
        ):
            assert 0.0 <= not_hidden <= alone and wait >= 0.0
            assert abs(exposed - (not_hidden + wait)) <= 1e-9 * max(1.0, exposed)
        assert row["peer_wait_seconds_max"] == max(row["peer_wait_seconds"])
    zigzag, contiguous = rows
    assert zigzag["imbalance_theoretical"] == 1.0
    # Rank 1's 256 tokens see 257..512 keys each, rank 0's see 1..256: 98432 vs 32896 pairs.
    assert abs(contiguous["imbalance_theoretical"] - 98432 / ((98432 + 32896) / 2)) < 1e-12


def test_bench_ring_rejects_bad_flags_with_one_line():
    result = CliRunner().invoke(app, ["bench", "ring", "--seq", "100", "--world", "4"])
    assert result.exit_code == 2
    assert "error: --seq: seq_len=100 cannot be split by layout 'zigzag' over 4 ranks" \
        in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, ["bench", "ring", "--heads", "8", "--kv-heads", "3"])
    assert result.exit_code == 2 and "--kv-heads: 3 must divide --heads 8" in result.output
    result = CliRunner().invoke(app, ["bench", "ring", "--layouts", "bogus"])
    assert result.exit_code == 2 and "error: --layouts: unknown kind 'bogus'; valid: " \
        "contiguous, zigzag" in result.output
    # 2e9 tokens: the kernel's out-of-memory killer ended it, without a word, before
    result = CliRunner().invoke(app, ["bench", "ring", "--seq", "2000000000"])
    assert result.exit_code == 2 and "error: --seq: 2000000000 is longer than 16777216" \
        in result.output
    result = CliRunner().invoke(app, ["bench", "train", "--layouts", ","])  # an IndexError
    assert result.exit_code == 2 and "error: --layouts: give at least one of" in result.output


def test_the_bench_seq_cap_is_the_job_files():
    from ringray.cli.bench import MAX_BENCH_SEQ
    from ringray.train.options import MAX_SEQ_LEN

    assert MAX_BENCH_SEQ == MAX_SEQ_LEN


def test_train_explains_a_low_overlap_when_ranks_outnumber_cores() -> None:
    """The quickstart's 4 ranks on a 2-core machine: `ringray train` says why ranks wait for
    their peers (peer wait, apart from the overlap) and which cp gives each rank a core; with
    a core per rank it says nothing."""
    from ringray.cli.train import oversubscription_note

    note = oversubscription_note(world=4, cores=2, cp=4)
    assert note is not None
    assert "4 ranks share 2 CPU core(s)" in note and "--set parallel.cp=2" in note
    assert "peer_wait_seconds" in note
    assert oversubscription_note(world=4, cores=8, cp=4) is None
    assert "--set parallel.cp=1" in oversubscription_note(world=4, cores=2, cp=2)  # dp=2
