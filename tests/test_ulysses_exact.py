"""Ulysses × ring attention on real gloo process groups equals attention on the whole sequence.

Grids (ring R × Ulysses U) 1 × 2, 2 × 2, 3 × 2 and 1 × 4; layouts zigzag and striped;
causal and full; MHA (8:8), GQA with U <= kv_heads (8:4, and 8:2 at U = 2) and with
U > kv_heads, where K/V heads are repeated (MQA 8:1, and 8:2 at U = 4); float32 and bfloat16;
plus packed documents with the balanced layout (and zigzag). Output, LSE (in the caller's
``(batch, q_heads, local_seq)`` form) and dq/dk/dv are checked on every rank against PyTorch
SDPA / float64 math on the unsharded sequence (tolerances: tests/ulysses_cases.py). Also:
the all-to-alls are recorded in ``RingStats`` beside the ring's steps.

Each grid is one launch of R × U processes that runs every case; each case is its own test.
"""

from __future__ import annotations

import pytest
import ulysses_cases as uc
from distributed import run_gloo_ranks

GRIDS = ((1, 2), (2, 2), (3, 2), (1, 4))
_results: dict[tuple[int, int], list[dict]] = {}


def results_for(ring: int, ulysses: int) -> list[dict]:
    if (ring, ulysses) not in _results:
        cases = uc.as_payload(uc.case_matrix(ulysses))
        _results[ring, ulysses] = run_gloo_ranks(ring * ulysses, uc.run_cases, ulysses, cases,
                                                 timeout_seconds=900)
    return _results[ring, ulysses]


PARAMS = [
    pytest.param(ring, ulysses, case.id, id=f"r{ring}xu{ulysses}-{case.id}")
    for ring, ulysses in GRIDS
    for case in uc.case_matrix(ulysses)
]


@pytest.mark.parametrize("ring,ulysses,case_id", PARAMS)
def test_ulysses_ring_matches_whole_sequence_attention(ring, ulysses, case_id):
    failures = [f"rank {rank}:\n{outcome[case_id]}"
                for rank, outcome in enumerate(results_for(ring, ulysses))
                if outcome[case_id] is not None]
    assert not failures, "\n".join(failures)


def test_matrix_covers_both_gqa_regimes():
    """Every U meets GQA with kv heads split over the group and with kv heads repeated."""
    for ulysses in (2, 4):
        kv = {uc.HEADS[c.heads][1] for c in uc.case_matrix(ulysses)}
        assert any(h % ulysses == 0 and h < 8 for h in kv), ulysses
        assert any(h < ulysses for h in kv), ulysses


def test_stats_record_the_all_to_alls_beside_the_ring():
    """A 2 × 2 grid: R forward and R backward ring steps, and five all-to-alls (q/k/v in,
    output and LSE back; dout in, dq/dk/dv back) with the bytes that left the rank and the
    seconds each took."""
    per_rank = run_gloo_ranks(4, uc.record_stats, 2, timeout_seconds=300)
    for rank, result in enumerate(per_rank):
        # After the all-to-all a rank holds 24 positions and one of the 2 kv heads (float32).
        kv_block = 2 * 1 * 1 * 24 * 16 * 4
        # A zigzag ring of 2: member 0 holds chunks 0 and 3, member 1 chunks 1 and 2, so
        # member 1 reads only chunk 0 of member 0's block (half of it), member 0 all of
        # member 1's. Backward: the other member's block is kept from the forward, so the
        # ring sends only the float32 dK/dV rows of it that the rank read.
        sent, returned = (kv_block // 2, kv_block) if rank < 2 else (kv_block, kv_block // 2)
        assert result["ring"] == [("forward", 0, sent), ("forward", 1, 0),
                                  ("backward", 0, 0), ("backward", 1, returned)]
        # Half of each packed buffer leaves the rank: q/k/v (4 + 2 + 2 heads) and the output
        # (4 heads) for 12 positions; the LSE (4 heads) likewise.
        qkv, out, lse = 12 * 8 * 16 * 4 // 2, 12 * 4 * 16 * 4 // 2, 12 * 4 * 4 // 2
        assert result["a2a"] == [("forward", "qkv", qkv), ("forward", "out", out),
                                 ("forward", "lse", lse), ("backward", "dout", out),
                                 ("backward", "dqkv", qkv)]
        # Each all-to-all was timed (a real interval, in seconds): all of them together
        # lie inside the wall time of the call that ran them.
        assert all(s > 0 for s in result["a2a_seconds"]), result["a2a_seconds"]
        assert sum(result["a2a_seconds"]) <= result["call_seconds"]
        totals = result["totals"]
        assert totals["a2a_calls"] == 5 and totals["a2a_bytes_sent"] == 2 * qkv + 2 * out + lse
        assert totals["a2a_seconds"] == pytest.approx(sum(result["a2a_seconds"]))
        assert totals["bytes_sent"] == sent + returned and result["forward_a2a_calls"] == 3
