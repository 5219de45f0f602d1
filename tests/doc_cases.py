"""Per-rank workers for the document-masked ring tests (importable by spawned ranks).

Every rank builds the same global q/k/v from a seed and computes the reference itself, on
the unsharded sequence, from the definition: float64 attention with a materialised
block-diagonal mask (``doc(i) == doc(j)``, and ``i >= j`` when causal), differentiated by
autograd. Then it runs ``ring_attention(..., documents=...)`` on its shard and compares its
shard of output, LSE and gradients:

- float32: within 1e-5 absolute and relative of float64;
- bfloat16: the error against float64 at most ``ring_cases.BF16_ERROR_FACTOR`` times the
  error of PyTorch SDPA in bfloat16 (same mask, whole sequence) against float64;
- LSE: within 1e-5 of float64 ``logsumexp``.
"""

from __future__ import annotations

import traceback
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from ring_cases import BF16_ERROR_FACTOR, F32_TOL, HEADS

from ringray.attention import RingStats, RingTotals, make_layout, ring_attention

BATCH = 2
SEQ = 120  # a multiple of 2N for N = 1..5, so every layout fits every ring size
DOCUMENT_SETS = {
    "whole": [SEQ],  # one document spanning the whole sequence
    "mixed": [1, 37, 2, 45, 1, 7, 27],  # a length-1 document; none a multiple of 2N
    "tiny": [1, 2, 3, 4, 5] * 8,  # many tiny documents
    "edge": [119, 1],  # a length-1 document last
}
# Mixes where most K/V transfers are skipped, for rings of 4 and 8 (256 tokens: 2N divides
# it): many short documents (1 to 11 tokens, a rank holds 32 or 64), a long tail, two
# documents longer than a rank's share among short ones, and one heavy document with most
# of the work (the ``whole`` layout builds its runs construction for it over 4 and 8 ranks).
SKIP_DOCUMENT_SETS = {
    "short": [1, 5, 11, 3, 8, 2, 9, 4, 7, 1, 10, 6] * 3 + [1, 5, 11, 3, 8, 2, 9, 4, 7, 5],
    "long-tail": [3, 1, 70, 4, 6, 2, 5, 1, 7, 2, 3, 90, 4, 1, 8, 2, 6, 3, 5, 33],
    "one-heavy": [1, 40, 3, 20, 4, 2, 4, 9, 6, 12, 6, 118, 12, 5, 9, 2, 3],
}
LAYOUTS = ("contiguous", "zigzag", "striped", "balanced", "random")
# Triton's interpreter costs about 5 ms per program: its cases use fewer, smaller heads.
HEADS = {**HEADS, "gqa-small": (4, 2, 16)}


@dataclass(frozen=True)
class DocCase:
    layout: str
    documents: str
    heads: str
    dtype: str
    causal: bool
    backend: str = "auto"

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        suffix = "" if self.backend == "auto" else f"-{self.backend}"
        return f"{self.layout}-{self.documents}-{self.heads}-{self.dtype}-{mask}{suffix}"


def documents_named(name: str) -> list[int]:
    return DOCUMENT_SETS[name] if name in DOCUMENT_SETS else SKIP_DOCUMENT_SETS[name]


def layout_for(name: str, world: int, documents: list[int]):
    seq = sum(documents)
    if name == "random":
        g = torch.Generator().manual_seed(99 + world)
        return make_layout(torch.randperm(seq, generator=g).view(world, -1).tolist(), world,
                           seq)
    return make_layout(name, world, seq, documents=documents)


def document_mask(documents: list[int], causal: bool) -> torch.Tensor:
    """``(S, S)`` bool: query i may see key j (from the definition, token by token)."""
    doc_of = [d for d, length in enumerate(documents) for _ in range(length)]
    seq = len(doc_of)
    return torch.tensor([[doc_of[i] == doc_of[j] and (not causal or i >= j)
                          for j in range(seq)] for i in range(seq)])


def global_inputs(heads: str, seed_text: str, dtype: torch.dtype, seq: int = SEQ):
    """q, k, v, dout in ``dtype`` (rounded from float64 draws), the same on every rank."""
    q_heads, kv_heads, head_dim = HEADS[heads]
    g = torch.Generator().manual_seed(zlib.crc32(seed_text.encode()))
    shapes = ((q_heads,), (kv_heads,), (kv_heads,), (q_heads,))
    return [torch.randn(BATCH, seq, h, head_dim, generator=g, dtype=torch.float64).to(dtype)
            for (h,) in shapes]


def masked_attention(q, k, v, dout, mask, compute_dtype):
    """Attention with an explicit mask in ``compute_dtype`` by autograd: out, lse, dq, dk, dv.
    float64: the reference math; bfloat16: through PyTorch SDPA (its own error, for scale)."""
    q, k, v = (t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    if compute_dtype == torch.float64:
        kf, vf = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kf) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), vf)
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=True,
        ).transpose(1, 2)
        lse = None
    out.backward(dout.to(compute_dtype))
    return out.detach(), lse, q.grad, k.grad, v.grad


def run_case(rank: int, world: int, case: DocCase) -> RingTotals:
    """Check one case on this rank (raising on a failed check); return its ring totals."""
    dtype = getattr(torch, case.dtype)
    documents = documents_named(case.documents)
    q_in, k_in, v_in, dout_in = global_inputs(case.heads, f"{case.heads}-{case.documents}",
                                              dtype, sum(documents))
    mask = document_mask(documents, case.causal)
    exact = masked_attention(q_in, k_in, v_in, dout_in, mask, torch.float64)
    sdpa = masked_attention(q_in, k_in, v_in, dout_in, mask, dtype) if dtype != torch.float32 \
        else None

    layout = layout_for(case.layout, world, documents)
    q, k, v = (layout.shard(t, rank).requires_grad_() for t in (q_in, k_in, v_in))
    stats = RingStats()
    out, lse = ring_attention(q, k, v, layout=layout, causal=case.causal, return_lse=True,
                              backend=case.backend, documents=documents, stats=stats)
    out.backward(layout.shard(dout_in, rank))
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        mine, want = got[name], layout.shard(exact[i], rank)
        assert torch.isfinite(mine).all(), f"{name} has NaN/inf"
        assert mine.dtype == dtype, f"{name} dtype {mine.dtype}"
        if dtype == torch.float32:
            torch.testing.assert_close(mine.double(), want, atol=F32_TOL, rtol=F32_TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            sdpa_error = (layout.shard(sdpa[i], rank).double() - want).abs().max().item()
            allowed = BF16_ERROR_FACTOR[case.backend] * sdpa_error
            torch.testing.assert_close(mine.double(), want, atol=allowed, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(lse.double(), layout.shard(exact[1], rank, dim=2),
                               atol=F32_TOL, rtol=F32_TOL)
    return stats.totals()


def run_cases(rank: int, world: int, cases: list[dict]) -> dict[str, str | None]:
    """Run many cases in one process group: case id -> None, or the failure's traceback."""
    outcome = {}
    for fields in cases:
        case = DocCase(**fields)
        try:
            run_case(rank, world, case)
            outcome[case.id] = None
        except Exception:  # noqa: BLE001 - one case's failure must not hide the others
            outcome[case.id] = traceback.format_exc()
    return outcome


def run_skip_cases(rank: int, world: int, cases: list[dict]) -> dict[str, dict]:
    """Like :func:`run_cases`, also reporting the messages this rank sent and skipped:
    case id -> {"error": None or the traceback, "transfers", "skipped", "bytes_sent",
    "bytes_skipped"}."""
    outcome = {}
    for fields in cases:
        case = DocCase(**fields)
        try:
            totals = run_case(rank, world, case)
            outcome[case.id] = {"error": None, "transfers": totals.transfers,
                                "skipped": totals.transfers_skipped,
                                "bytes_sent": totals.bytes_sent,
                                "bytes_skipped": totals.bytes_skipped}
        except Exception:  # noqa: BLE001 - one case's failure must not hide the others
            outcome[case.id] = {"error": traceback.format_exc()}
    return outcome


def case_matrix() -> list[DocCase]:
    """Every layout × document set × causal/full; heads and dtype rotate so that MHA and
    GQA each meet both dtypes, both masks and every layout."""
    combos = [("mha", "float32"), ("gqa", "bfloat16"), ("gqa", "float32"), ("mha", "bfloat16")]
    cases = []
    for i, (layout, docs, causal) in enumerate(
        (lay, docs, causal) for lay in LAYOUTS for docs in DOCUMENT_SETS
        for causal in (True, False)
    ):
        heads, dtype = combos[(i + i // 8) % 4]
        cases.append(DocCase(layout, docs, heads, dtype, causal))
    return cases


def as_payload(cases: list[DocCase]) -> list[dict]:
    return [asdict(c) for c in cases]


def no_leak(rank: int, world: int, layout_name: str, backend: str, heads: str) -> list[str]:
    """Change one document's q/k/v; every other document's output and gradients must be
    bit-identical. Returns the names of the tensors that changed where they must not."""
    documents = DOCUMENT_SETS["mixed"]
    changed_doc = 3  # positions 40..84, a 45-token document spread over ranks
    start = sum(documents[:changed_doc])
    end = start + documents[changed_doc]
    layout = layout_for(layout_name, world, documents)
    results = []
    for variant in range(2):
        q_in, k_in, v_in, dout_in = global_inputs(heads, "no-leak", torch.float32)
        if variant:
            g = torch.Generator().manual_seed(5)
            for t in (q_in, k_in, v_in):
                t[:, start:end] = torch.randn(t[:, start:end].shape, generator=g) * 3
        q, k, v = (layout.shard(t, rank).requires_grad_() for t in (q_in, k_in, v_in))
        out = ring_attention(q, k, v, layout=layout, documents=documents, backend=backend)
        out.backward(layout.shard(dout_in, rank))
        results.append({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})
    pos = layout.positions(rank)
    others = (pos < start) | (pos >= end)
    leaks = [name for name in results[0]
             if not torch.equal(results[0][name][:, others], results[1][name][:, others])]
    inside = ~others
    if inside.any() and torch.equal(results[0]["out"][:, inside], results[1]["out"][:, inside]):
        leaks.append("the changed document's own output did not change (test is void)")
    return leaks
