"""Checks shared by the tests of ``ringray bench ring``'s JSON rows."""

from __future__ import annotations

import statistics

import pytest


def assert_summary_follows_from_the_ranks(row: dict, *, ranks: int) -> None:
    """A row's summary figures are what their names say, computed from its per-rank ones:
    every rank computed, the max and mean are of the ranks' compute seconds, the measured
    imbalance is max ÷ mean, and work efficiency is the ranks' total compute ÷ the single
    process's."""
    compute = row["compute_seconds"]
    assert len(compute) == ranks and min(compute) > 0, compute
    assert row["single_process_seconds"] > 0
    mean = statistics.mean(compute)
    assert row["compute_seconds_max"] == max(compute)
    assert row["compute_seconds_mean"] == pytest.approx(mean, rel=1e-12)
    assert row["imbalance_measured"] == pytest.approx(max(compute) / mean, rel=1e-12)
    assert row["work_efficiency"] == pytest.approx(
        sum(compute) / row["single_process_seconds"], rel=1e-12)
    assert row["exposed_comm_seconds_max"] == max(row["exposed_comm_seconds"])
