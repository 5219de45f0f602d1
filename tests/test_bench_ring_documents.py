"""``ringray bench ring --documents SPEC``: the document mixes it packs, a run end to end with
the balanced layout in the default list, and one-line errors for a bad spec."""

from __future__ import annotations

import json
import statistics

import pytest
from bench_rows import assert_summary_follows_from_the_ranks
from typer.testing import CliRunner

from ringray.bench.ring import document_lengths
from ringray.cli import app


def test_stdlib_packs_the_corpus_lengths_in_order():
    from ringray.data import StdlibSource

    corpus = list(StdlibSource().document_lengths)
    packed = document_lengths("stdlib", 16384)
    assert sum(packed) == 16384
    assert packed[:-1] == corpus[: len(packed) - 1]  # whole documents, byte = token
    assert 1 <= packed[-1] <= corpus[len(packed) - 1]  # the last one cut to fit


def test_lognormal_and_fixed_mixes():
    lengths = document_lengths("lognormal:512", 1 << 18)
    assert sum(lengths) == 1 << 18 and min(lengths) >= 1
    assert 400 < statistics.mean(lengths[:-1]) < 640  # seeded; mean near 512
    assert lengths == document_lengths("lognormal:512", 1 << 18)
    assert document_lengths("fixed:1000", 2500) == [1000, 1000, 500]
    assert document_lengths("lognormal:512:1", 1 << 16) == document_lengths("lognormal:512",
                                                                            1 << 16)


def test_long_tail_mix():
    """``lognormal:1024:2``, the benchmark's long-tail mix: at 64k a few documents longer
    than a rank's share over 8 ranks (8192 tokens) among many short ones."""
    lengths = document_lengths("lognormal:1024:2", 1 << 16)
    assert sum(lengths) == 1 << 16
    assert 1 <= sum(n > 8192 for n in lengths) <= 3
    assert statistics.median(lengths) < 300 and len(lengths) > 50


@pytest.mark.parametrize(("spec", "message"), [
    ("zipf",
     "--documents: unknown spec 'zipf'; valid: stdlib, lognormal:MEAN[:SIGMA], fixed:LEN"),
    ("fixed:0", "--documents: 'fixed:0': LEN must be a whole number of tokens >= 1"),
    ("lognormal:big", "--documents: 'lognormal:big': MEAN must be a number of tokens >= 1"),
    ("lognormal:512:wide",
     "--documents: 'lognormal:512:wide': SIGMA must be a number in (0, 4], e.g. lognormal:512:2"),
    ("lognormal:100:1:3",  # it said MEAN must be a number
     "--documents: 'lognormal:100:1:3': too many ':' parts; the form is lognormal:MEAN[:SIGMA]"),
])
def test_bad_specs_fail_with_one_line(spec, message):
    result = CliRunner().invoke(app, ["bench", "ring", "--documents", spec])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_bench_ring_with_documents_reports_every_layout():
    result = CliRunner().invoke(app, [
        "bench", "ring", "--world", "2", "--seq", "512", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--documents", "lognormal:60", "--iters", "1", "--json",
    ])
    assert result.exit_code == 0, result.output
    rows = {r["layout"]: r for r in json.loads(result.stdout)}
    assert list(rows) == ["zigzag", "striped", "contiguous", "balanced", "whole"]
    for row in rows.values():
        assert_summary_follows_from_the_ranks(row, ranks=2)
        assert row["step_imbalance_theoretical"] >= row["imbalance_theoretical"] - 1e-9
    assert rows["balanced"]["imbalance_theoretical"] <= 1.02
    assert rows["whole"]["imbalance_theoretical"] <= 1.02
    assert rows["whole"]["bytes_sent_per_rank"] < rows["balanced"]["bytes_sent_per_rank"]


def test_bench_ring_runs_the_plain_rings_traffic_beside_the_plan():
    """``--transfers all,mask``: each layout runs twice in one run, every block to every
    rank and only what readers read; the plain ring's traffic sends more, and the table
    shows both with the bytes and the call time."""
    args = ["bench", "ring", "--world", "2", "--seq", "512", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "16", "--documents", "lognormal:60", "--iters", "1",
            "--layouts", "whole", "--transfers", "all,mask"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["layout"], r["transfers"]) for r in rows] == [("whole", "all"),
                                                              ("whole", "mask")]
    assert rows[0]["bytes_sent_per_rank"] > rows[1]["bytes_sent_per_rank"]
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "transfers" in table.output and "sent MiB" in table.output
    bad = CliRunner().invoke(app, [*args[:-1], "all,some"])
    assert bad.exit_code == 2
    assert "--transfers: 'all,some' is not a comma-separated list of mask, all" in bad.output
