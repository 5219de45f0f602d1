"""Sliding-window ring attention on real gloo process groups equals PyTorch SDPA with the
explicit mask (fp32, 1e-5, output, LSE and dq/dk/dv on every rank), and skips what lies
beyond the window.

Rings of 1 to 4; layouts contiguous, zigzag, striped, balanced and a random permutation;
windows of 1, 3 and 17 tokens and one longer than the sequence; with and without packed
documents (the window then applies within a document); MHA and GQA; the sdpa backend, and on
rings of 2 and 3 also the reference backend and the Triton kernels. Cases in
``tests/window_cases.py``; one spawn per ring size.
"""

from __future__ import annotations

import pytest
import window_cases as wc
from distributed import run_gloo_ranks

from ringray.attention.documents import check_documents
from ringray.attention.transfers import plan_transfers

WORLD_SIZES = (1, 2, 3, 4)
_results: dict[int, list[dict]] = {}


def results_for(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_gloo_ranks(world, wc.run_cases,
                                         wc.as_payload(wc.case_matrix(world)),
                                         timeout_seconds=600)
    return _results[world]


@pytest.mark.parametrize("world,case", [
    pytest.param(w, c, id=f"n{w}-{c.id}") for w in WORLD_SIZES for c in wc.case_matrix(w)
])
def test_window_ring_matches_sdpa_with_the_mask(world, case):
    results = results_for(world)
    failures = [f"rank {rank}:\n{outcome[case.id]['error']}"
                for rank, outcome in enumerate(results) if outcome[case.id]["error"]]
    assert not failures, "\n".join(failures)
    # Each rank skipped what the plan for this window skips.
    documents = wc.DOCUMENTS[case.documents]
    layout = wc.layout_for(case, world, documents)
    window = case.window if case.window < wc.SEQ else None
    plan = plan_transfers(layout, True, check_documents(documents, wc.SEQ), window)
    for rank, outcome in enumerate(results):
        counts = plan.counts(rank)
        assert outcome[case.id]["skipped"] == counts.forward_skipped + counts.backward_skipped


def test_a_short_window_sends_less_than_no_window():
    """On 4 ranks, contiguous blocks of 24 tokens: a 3-token window reads only the previous
    rank's block (one K/V block forward per rank but the last's), where a window longer than
    the sequence reads every earlier block."""
    results = results_for(4)
    short = wc.WindowCase("contiguous", 3, "none", "mha").id
    whole = wc.WindowCase("contiguous", wc.SEQ + 5, "none", "mha").id
    sent_short = sum(r[short]["sent"] for r in results)
    sent_whole = sum(r[whole]["sent"] for r in results)
    assert sent_short < sent_whole / 2, (sent_short, sent_whole)
