"""``ring_attention(..., backend="triton")`` on real gloo process groups equals PyTorch SDPA
on the unsharded sequence, forward and backward, on rings of 2 and 4 processes.

This is the fused path end to end: one kernel per ring step that merges into the ring's
(out, LSE) accumulators, and a backward that adds into float32 dQ/dK/dV with ``delta``
computed once per call. The kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set by conftest.py and inherited by the spawned ranks), about 5 ms per program, so the
matrix is sparse by design: on each ring size every layout (contiguous, zigzag, striped, a
random permutation; the seed's token fold at 4), both dtypes, causal and full, and GQA, MQA
and odd shapes (5 heads, head_dim 80) each appear at least once. The kernels' own tests
cover the full cross product one block pair at a time.

Checks and tolerances are those of ``tests/ring_cases.py`` (float32: 1e-5 against SDPA;
bfloat16: ``BF16_ERROR_FACTOR["triton"]`` times SDPA's own error against float64; LSE
against float64, 1e-5). Sequence 80: 40 tokens per rank at N=2 and 20 at N=4, neither a
multiple of the 32-token interpreter tile.
"""

from __future__ import annotations

import pytest
import ring_cases as rc
from distributed import run_gloo_ranks

pytest.importorskip("triton")

SEQ = 80
CASES = {
    2: [
        rc.Case("zigzag", "gqa", "bfloat16", True, SEQ, "triton"),
        rc.Case("striped", "mqa", "float32", True, SEQ, "triton"),
        rc.Case("contiguous", "odd", "float32", True, SEQ, "triton"),
        rc.Case("random", "odd-mqa", "bfloat16", True, SEQ, "triton"),
        rc.Case("zigzag", "gqa", "float32", False, SEQ, "triton"),
    ],
    4: [
        rc.Case("zigzag", "mqa", "float32", True, SEQ, "triton"),
        rc.Case("striped", "odd-mqa", "bfloat16", True, SEQ, "triton"),
        rc.Case("contiguous", "gqa", "bfloat16", True, SEQ, "triton"),
        rc.Case("random", "gqa", "float32", False, SEQ, "triton"),
        rc.Case("fold", "mqa", "bfloat16", True, 16, "triton"),
    ],
}
_results: dict[int, list[dict]] = {}


def results_for(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_gloo_ranks(world, rc.run_cases, rc.as_payload(CASES[world]),
                                         timeout_seconds=300)
    return _results[world]


@pytest.mark.parametrize(
    "world,case_id",
    [pytest.param(w, c.id, id=f"n{w}-{c.id}") for w, cases in CASES.items() for c in cases],
)
def test_triton_ring_matches_sdpa(world, case_id):
    failures = [
        f"rank {rank}:\n{outcome[case_id]['error']}"
        for rank, outcome in enumerate(results_for(world))
        if not outcome[case_id]["ok"]
    ]
    assert not failures, "\n".join(failures)
