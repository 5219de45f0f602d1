"""Per-rank workers for the Ulysses × ring tests (importable by spawned ranks).

A launch of R × U gloo processes forms the grid once (:func:`grid_groups`: Ulysses groups of
U consecutive ranks, rings of the ranks sharing an ulysses index) and runs many cases. Every
rank builds the same global q/k/v from a seed and computes the references itself on the
unsharded sequence, then runs ``ring_attention(..., ulysses_group=...)`` on its shard of the
grid layout and compares its shard of output, LSE and gradients:

- float32: within 1e-5 (absolute and relative) of PyTorch SDPA in float32 (of float64 math
  with documents, where SDPA would need a dense mask anyway);
- bfloat16: the error against float64 at most ``BF16_ERROR_FACTOR`` times SDPA's own bf16
  error against float64 (the rule of tests/test_ring_exact.py);
- LSE ``(batch, q_heads, local_seq)``: within 1e-5 of float64 ``logsumexp``.
"""

from __future__ import annotations

import time
import traceback
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from doc_cases import document_mask, masked_attention
from ring_cases import BF16_ERROR_FACTOR, F32_TOL, lse_reference, sdpa_reference

from ringray.attention import RingStats, make_layout, ring_attention
from ringray.attention.ulysses import grid_groups

BATCH = 2
SEQ = 96  # a multiple of lcm(2R, R*U) for every grid tested
# (q_heads, kv_heads, head_dim)
HEADS = {
    "mha": (8, 8, 16),
    "gqa4": (8, 4, 16),  # kv heads split over U = 2 and U = 4
    "gqa2": (8, 2, 16),  # split over U = 2; repeated x2 for U = 4
    "mqa": (8, 1, 16),  # repeated U times
}
DOCUMENT_SETS = {
    "mixed": [1, 37, 2, 29, 1, 7, 19],  # a length-1 document first; none a multiple of 2R
    "edge": [95, 1],
}


@dataclass(frozen=True)
class UlyssesCase:
    layout: str
    heads: str
    dtype: str
    causal: bool
    documents: str | None = None

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        docs = f"-{self.documents}" if self.documents else ""
        return f"{self.layout}{docs}-{self.heads}-{self.dtype}-{mask}"


def heads_for(ulysses: int) -> list[str]:
    """Head sets that cover, for this U, MHA, GQA with U <= kv_heads and U > kv_heads."""
    return [h for h in HEADS if h != "gqa2" or ulysses == 4]


def case_matrix(ulysses: int) -> list[UlyssesCase]:
    cases = [
        UlyssesCase(layout, heads, dtype, causal)
        for layout in ("zigzag", "striped")
        for heads in heads_for(ulysses)
        for dtype in ("float32", "bfloat16")
        for causal in (True, False)
    ]
    cases += [
        UlyssesCase("balanced", "gqa4", "float32", True, "mixed"),
        UlyssesCase("balanced", "mqa", "bfloat16", True, "mixed"),
        UlyssesCase("balanced", "mha", "float32", False, "edge"),
        UlyssesCase("zigzag", "mqa", "float32", True, "mixed"),
    ]
    return cases


def global_inputs(case: UlyssesCase, dtype: torch.dtype):
    """q, k, v, dout in ``dtype`` (rounded from float64 draws), the same on every rank."""
    q_heads, kv_heads, head_dim = HEADS[case.heads]
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.heads}-{case.documents}".encode()))
    heads = (q_heads, kv_heads, kv_heads, q_heads)
    return [torch.randn(BATCH, SEQ, h, head_dim, generator=g, dtype=torch.float64).to(dtype)
            for h in heads]


def references(case: UlyssesCase, q, k, v, dout):
    """(float64 exact out/lse/dq/dk/dv, same-dtype SDPA out/dq/dk/dv or None)."""
    dtype = q.dtype
    if case.documents is None:
        exact_out, *exact_grads = sdpa_reference(*(t.double() for t in (q, k, v, dout)),
                                                 case.causal)
        exact = (exact_out, lse_reference(q, k, case.causal), *exact_grads)
        return exact, sdpa_reference(q, k, v, dout, case.causal)
    mask = document_mask(DOCUMENT_SETS[case.documents], case.causal)
    exact = masked_attention(q, k, v, dout, mask, torch.float64)
    if dtype == torch.float32:
        return exact, None
    out, _, dq, dk, dv = masked_attention(q, k, v, dout, mask, dtype)
    return exact, (out, dq, dk, dv)


def run_case(rank: int, ring_size: int, ulysses: int, groups, case: UlyssesCase) -> None:
    """One case on this rank of the grid; raises on a failed check."""
    dtype = getattr(torch, case.dtype)
    q_in, k_in, v_in, dout_in = global_inputs(case, dtype)
    exact, same_dtype = references(case, q_in, k_in, v_in, dout_in)
    documents = DOCUMENT_SETS[case.documents] if case.documents else None
    layout = make_layout(case.layout, ring_size * ulysses, SEQ, ulysses=ulysses,
                         documents=documents)
    ring_group, ulysses_group = groups
    q, k, v = (layout.shard(t, rank).requires_grad_() for t in (q_in, k_in, v_in))
    out, lse = ring_attention(q, k, v, ring_group, ulysses_group=ulysses_group,
                              layout=case.layout, causal=case.causal, return_lse=True,
                              documents=documents)
    out.backward(layout.shard(dout_in, rank))
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    assert lse.shape == (BATCH, q.shape[2], q.shape[1]), f"lse shape {tuple(lse.shape)}"
    exact_by_name = dict(zip(("out", "lse", "dq", "dk", "dv"), exact, strict=True))
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        mine, want = got[name], layout.shard(exact_by_name[name], rank)
        assert mine.shape == want.shape, f"{name} shape {tuple(mine.shape)}"
        assert torch.isfinite(mine).all(), f"{name} has NaN/inf"
        assert mine.dtype == dtype, f"{name} dtype {mine.dtype}"
        if dtype == torch.float32:
            ref = want if same_dtype is None else layout.shard(same_dtype[i], rank).double()
            torch.testing.assert_close(mine.double(), ref, atol=F32_TOL, rtol=F32_TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            sdpa_error = (layout.shard(same_dtype[i], rank).double() - want).abs().max().item()
            allowed = BF16_ERROR_FACTOR["auto"] * sdpa_error
            torch.testing.assert_close(mine.double(), want, atol=allowed, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(lse.double(), layout.shard(exact_by_name["lse"], rank, dim=2),
                               atol=F32_TOL, rtol=F32_TOL)


def run_cases(rank: int, world: int, ulysses: int, cases: list[dict]) -> dict[str, str | None]:
    """Every case on one grid: case id -> None, or the failure's traceback."""
    groups = grid_groups(ulysses)
    outcome = {}
    for fields in cases:
        case = UlyssesCase(**fields)
        try:
            run_case(rank, world // ulysses, ulysses, groups, case)
            outcome[case.id] = None
        except Exception:  # noqa: BLE001 - one case's failure must not hide the others
            outcome[case.id] = traceback.format_exc()
    return outcome


def as_payload(cases: list[UlyssesCase]) -> list[dict]:
    return [asdict(c) for c in cases]


def record_stats(rank: int, world: int, ulysses: int) -> dict:
    """One forward + backward with a RingStats; returns what it recorded."""
    ring_group, ulysses_group = grid_groups(ulysses)
    torch.manual_seed(0)
    layout = make_layout("zigzag", world, 48, ulysses=ulysses)
    q, k, v = (layout.shard(torch.randn(1, 48, h, 16), rank).requires_grad_()
               for h in (4, 2, 2))
    stats = RingStats()
    started = time.perf_counter()
    out, _ = ring_attention(q, k, v, ring_group, ulysses_group=ulysses_group, layout=layout,
                            stats=stats, return_lse=True)
    out.sum().backward()
    call_seconds = time.perf_counter() - started
    totals = stats.totals()
    return {
        "ring": [(r.phase, r.step, r.bytes_sent) for r in stats.records],
        "a2a": [(r.phase, r.name, r.bytes_sent) for r in stats.a2a_records],
        "a2a_seconds": [r.seconds for r in stats.a2a_records],
        "call_seconds": call_seconds,  # the forward and backward, on the wall clock
        "totals": asdict(totals),
        "forward_a2a_calls": stats.totals("forward").a2a_calls,
        "rank": dist.get_rank(),
    }
