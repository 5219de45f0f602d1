"""Per-rank workers for the sliding-window ring tests (importable by spawned ranks).

Every rank builds the same global q/k/v from a seed and computes the reference itself, on the
unsharded sequence: PyTorch SDPA in float32 with an explicit boolean mask built token by
token from the definition (``j <= i``, ``i - j <= window - 1``, same document), autograd for
the gradients, and the LSE as float64 ``logsumexp`` of the masked scores. Then it runs
``ring_attention(..., window=...)`` on its shard and compares its shard of output, LSE and
dq/dk/dv within 1e-5 (absolute and relative), and reports the messages the call skipped.
"""

from __future__ import annotations

import traceback
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from ring_cases import F32_TOL, HEADS

from ringray.attention import RingStats, make_layout, ring_attention

BATCH = 2
SEQ = 96  # a multiple of 2N for N = 1..4
DOCUMENTS = {"none": None, "mixed": [1, 30, 7, 2, 40, 16]}
HEADS = {**HEADS, "gqa-small": (4, 2, 16)}  # Triton's interpreter: few, small heads


@dataclass(frozen=True)
class WindowCase:
    layout: str  # contiguous | zigzag | striped | balanced | random
    window: int
    documents: str  # a key of DOCUMENTS
    heads: str
    backend: str = "auto"

    @property
    def id(self) -> str:
        suffix = "" if self.backend == "auto" else f"-{self.backend}"
        return f"{self.layout}-w{self.window}-{self.documents}-{self.heads}{suffix}"


def window_mask(seq: int, window: int, documents: list[int] | None) -> torch.Tensor:
    """``(S, S)`` bool, token by token from the definition."""
    doc_of = ([d for d, length in enumerate(documents) for _ in range(length)]
              if documents is not None else [0] * seq)
    return torch.tensor([[j <= i and i - j <= window - 1 and doc_of[i] == doc_of[j]
                          for j in range(seq)] for i in range(seq)])


def layout_for(case: WindowCase, world: int, documents: list[int] | None):
    if case.layout == "random":
        g = torch.Generator().manual_seed(7 + world)
        return make_layout(torch.randperm(SEQ, generator=g).view(world, -1).tolist(), world,
                           SEQ)
    return make_layout(case.layout, world, SEQ, documents=documents)


def run_case(rank: int, world: int, case: WindowCase) -> dict:
    documents = DOCUMENTS[case.documents]
    q_heads, kv_heads, head_dim = HEADS[case.heads]
    g = torch.Generator().manual_seed(zlib.crc32(f"window-{case.heads}".encode()))
    q_in, dout_in = (torch.randn(BATCH, SEQ, q_heads, head_dim, generator=g) for _ in range(2))
    k_in, v_in = (torch.randn(BATCH, SEQ, kv_heads, head_dim, generator=g) for _ in range(2))
    mask = window_mask(SEQ, case.window, documents)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q_in, k_in, v_in))
    ref = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2),
                                         vr.transpose(1, 2), attn_mask=mask,
                                         enable_gqa=True).transpose(1, 2)
    ref.backward(dout_in)
    groups = q_heads // kv_heads
    scores = torch.einsum("bqhd,bkhd->bhqk", q_in.double(),
                          k_in.double().repeat_interleave(groups, 2)) * head_dim**-0.5
    lse_ref = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)

    layout = layout_for(case, world, documents)
    q, k, v = (layout.shard(t, rank).requires_grad_() for t in (q_in, k_in, v_in))
    stats = RingStats()
    out, lse = ring_attention(q, k, v, layout=layout, causal=True, window=case.window,
                              documents=documents, backend=case.backend, return_lse=True,
                              stats=stats)
    out.backward(layout.shard(dout_in, rank))
    for name, mine, want in (("out", out.detach(), ref.detach()), ("dq", q.grad, qr.grad),
                             ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad)):
        torch.testing.assert_close(mine, layout.shard(want, rank), atol=F32_TOL, rtol=F32_TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(lse.double(), layout.shard(lse_ref, rank, dim=2), atol=F32_TOL,
                               rtol=F32_TOL, msg=lambda m: f"lse: {m}")
    totals = stats.totals()
    return {"error": None, "skipped": totals.transfers_skipped, "sent": totals.bytes_sent}


def run_cases(rank: int, world: int, cases: list[dict]) -> dict[str, dict]:
    """Run many cases in one process group: case id -> {"error": None or the traceback,
    "skipped": messages skipped, "sent": bytes sent}."""
    outcome = {}
    for fields in cases:
        case = WindowCase(**fields)
        try:
            outcome[case.id] = run_case(rank, world, case)
        except Exception:  # noqa: BLE001 - one case's failure must not hide the others
            outcome[case.id] = {"error": traceback.format_exc()}
    return outcome


def case_matrix(world: int) -> list[WindowCase]:
    """Windows of 1 (a query sees itself), a few tokens, about a block, and longer than the
    sequence; every layout, with and without documents (balanced: with); on rings of 2 and 3
    also the reference backend and the Triton kernels (interpreted on CPU)."""
    cases = []
    heads = ("mha", "gqa")
    for i, (layout, window, documents) in enumerate(
        (lay, w, d) for lay in ("contiguous", "zigzag", "striped", "random")
        for w in (1, 3, 17, SEQ + 5) for d in DOCUMENTS
    ):
        cases.append(WindowCase(layout, window, documents, heads[i % 2]))
    cases += [WindowCase("balanced", w, "mixed", "gqa") for w in (1, 3, 17, SEQ + 5)]
    if world in (2, 3):
        cases += [WindowCase("zigzag", 5, "none", "gqa-small", "triton"),
                  WindowCase("balanced", 17, "mixed", "gqa-small", "triton"),
                  WindowCase("striped", 3, "mixed", "gqa", "reference")]
    return cases


def as_payload(cases: list[WindowCase]) -> list[dict]:
    return [asdict(c) for c in cases]
