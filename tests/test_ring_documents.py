"""Document-masked ring attention on real gloo process groups equals float64 attention with a
materialised block-diagonal (causal) mask, and no document leaks into another.

Ring sizes 1 to 5; layouts contiguous, zigzag, striped, balanced and a random permutation;
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
    3: [dc.DocCase("contiguous", "edge", "gqa-small", "float32", True, "triton"),
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


@pytest.mark.parametrize(("world", "layout", "backend", "heads"), [
    (3, "balanced", "auto", "gqa"), (3, "striped", "auto", "gqa"),
    (3, "random", "auto", "gqa"), (2, "zigzag", "triton", "gqa-small"),
])
def test_changing_one_document_leaves_the_others_bit_identical(world, layout, backend, heads):
    """Every other document's output and dq/dk/dv are ``torch.equal`` after one document's
    q/k/v change (and that document's own output does change)."""
    leaks = run_gloo_ranks(world, dc.no_leak, layout, backend, heads, timeout_seconds=300)
    assert all(not rank_leaks for rank_leaks in leaks), leaks
