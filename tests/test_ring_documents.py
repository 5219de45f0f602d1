"""Document-masked ring attention on real gloo process groups equals float64 attention with a
materialised block-diagonal (causal) mask, and no document leaks into another.

Ring sizes 1 to 5; layouts contiguous, zigzag, striped, balanced (whole in the skip and
no-leak cases, and with Triton) and a random permutation;
causal and full; MHA and GQA; float32 and bfloat16; document sets with a length-1 document,
lengths that are no multiple of 2N, one document over the whole sequence, and 40 tiny
documents (which the planner handles by tiles). Forward output, LSE and dq/dk/dv on every
rank; tolerances in ``tests/doc_cases.py``. One spawn per ring size runs every case; each
case is its own test. The ``reference`` and ``triton`` backends (Triton's interpreter on CPU)
run a few cases each on rings of 2 and 3.
"""

from __future__ import annotations

import doc_cases as dc
import pytest
from distributed import run_gloo_ranks

WORLD_SIZES = (1, 2, 3, 4, 5)
OTHER_BACKENDS = {
    2: [dc.DocCase("balanced", "mixed", "gqa-small", "float32", True, "triton"),
        dc.DocCase("striped", "tiny", "gqa-small", "bfloat16", True, "triton"),
        dc.DocCase("zigzag", "mixed", "gqa-small", "float32", False, "triton"),
        dc.DocCase("random", "mixed", "gqa", "float32", True, "reference"),
        dc.DocCase("balanced", "tiny", "mha", "float32", False, "reference")],
    3: [dc.DocCase("whole", "mixed", "gqa-small", "float32", True, "triton"),
        dc.DocCase("contiguous", "edge", "gqa-small", "float32", True, "triton"),
        dc.DocCase("balanced", "whole", "gqa-small", "bfloat16", False, "triton"),
        dc.DocCase("striped", "mixed", "gqa", "float32", True, "reference")],
}
_results: dict[int, list[dict]] = {}


def cases_for(world: int) -> list[dc.DocCase]:
    return dc.case_matrix() + OTHER_BACKENDS.get(world, [])


def results_for(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_gloo_ranks(world, dc.run_cases, dc.as_payload(cases_for(world)),
                                         timeout_seconds=300)
    return _results[world]


@pytest.mark.parametrize(
    "world,case_id",
    [pytest.param(w, c.id, id=f"n{w}-{c.id}") for w in WORLD_SIZES for c in cases_for(w)],
)
def test_document_ring_matches_float64(world, case_id):
    failures = [f"rank {rank}:\n{outcome[case_id]}"
                for rank, outcome in enumerate(results_for(world)) if outcome[case_id]]
    assert not failures, "\n".join(failures)


SKIP_CASES = [
    dc.DocCase(layout, documents, heads, "float32", causal, backend)
    for layout, documents, heads, causal, backend in (
        ("contiguous", "short", "gqa", True, "auto"),
        ("contiguous", "short", "mha", False, "auto"),
        ("balanced", "short", "gqa", True, "auto"),
        ("zigzag", "short", "mha", True, "reference"),
        ("contiguous", "long-tail", "gqa", True, "auto"),
        ("zigzag", "long-tail", "gqa", False, "auto"),
        ("balanced", "long-tail", "mha", True, "auto"),
        ("whole", "one-heavy", "gqa", True, "auto"),
        ("whole", "short", "mha", False, "auto"),
        ("striped", "long-tail", "gqa", True, "auto"),
    )
]
SKIP_TRITON = [dc.DocCase("balanced", "short", "gqa-small", "float32", True, "triton")]
_skip_results: dict[int, list[dict]] = {}


def skip_results(world: int) -> list[dict]:
    if world not in _skip_results:
        cases = SKIP_CASES + (SKIP_TRITON if world == 4 else [])
        _skip_results[world] = run_gloo_ranks(world, dc.run_skip_cases, dc.as_payload(cases),
                                               timeout_seconds=600)
    return _skip_results[world]


@pytest.mark.parametrize("world,case", [
    pytest.param(w, c, id=f"n{w}-{c.id}") for w in (4, 8)
    for c in SKIP_CASES + (SKIP_TRITON if w == 4 else [])
])
def test_skipped_transfers_keep_the_ring_exact(world, case):
    """Mixes where most K/V blocks are read by nobody (many short documents; a long tail
    of a few documents longer than a rank's share) on rings of 4 and 8: every rank's output,
    LSE and dq/dk/dv match float64 (fp32, 1e-5), each rank's stats count the messages the
    transfer plan skips, against the plain ring's 3 (N - 1) per rank and call, and the bytes
    it sent are the plan's: only the rows each reader reads."""
    from ringray.attention.documents import check_documents
    from ringray.attention.transfers import plan_transfers

    results = skip_results(world)
    failures = [f"rank {rank}:\n{outcome[case.id]['error']}"
                for rank, outcome in enumerate(results) if outcome[case.id]["error"]]
    assert not failures, "\n".join(failures)
    documents = dc.documents_named(case.documents)
    layout = dc.layout_for(case.layout, world, documents)
    plan = plan_transfers(layout, case.causal, check_documents(documents, sum(documents)))
    _, kv_heads, head_dim = dc.HEADS[case.heads]
    row = dc.BATCH * 2 * kv_heads * head_dim * 4  # K and V (or dK and dV) of a row, float32
    for rank, outcome in enumerate(results):
        counts = plan.counts(rank)
        got = outcome[case.id]
        assert got["skipped"] == counts.forward_skipped + counts.backward_skipped
        assert got["transfers"] + got["skipped"] == 3 * (world - 1)
        assert got["bytes_sent"] == counts.bytes_sent(row, row), (rank, got)
        assert got["bytes_sent"] + got["bytes_skipped"] == counts.ring_bytes(row, row)
    sent = sum(r[case.id]["bytes_sent"] for r in results)
    skipped = sum(r[case.id]["bytes_skipped"] for r in results)
    if case.documents == "short" and case.layout != "striped":
        assert skipped > sent, f"only {skipped} of {sent + skipped} bytes skipped"
    print(f"n{world} {case.id}: {sent} bytes sent, {skipped} skipped "
          f"({skipped / (sent + skipped):.0%})")


@pytest.mark.parametrize(("world", "layout", "backend", "heads"), [
    (3, "balanced", "auto", "gqa"), (3, "whole", "auto", "gqa"), (3, "striped", "auto", "gqa"),
    (3, "random", "auto", "gqa"), (2, "zigzag", "triton", "gqa-small"),
])
def test_changing_one_document_leaves_the_others_bit_identical(world, layout, backend, heads):
    """Every other document's output and dq/dk/dv are ``torch.equal`` after one document's
    q/k/v change (and that document's own output does change)."""
    leaks = run_gloo_ranks(world, dc.no_leak, layout, backend, heads, timeout_seconds=300)
    assert all(not rank_leaks for rank_leaks in leaks), leaks
