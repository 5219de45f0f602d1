"""The Triton ring-step kernels with packed documents, against float64 math with the
document mask built from the definition, under ``TRITON_INTERPRET=1`` on CPU (conftest.py).

One block pair at a time, as a ring step gives it: 40 query and 40 key tokens (not a
multiple of the 32-token tile) of an 80-token sequence holding six documents (one of length
1), in the position patterns of every layout (contiguous, zigzag, striped, balanced, a
random permutation), causal and full, GQA (4 query heads on 2 kv heads), float32 and a few
bfloat16 cases. Forward output and LSE, and dQ/dK/dV given the final LSE and ``delta``, as
the ring calls them. Rows that see no key must come out exactly: lse -inf, output 0, zero
gradients. And the tile skipping must be visible: fewer tile pairs visited with documents
than without, and pairs inside one document computed unmasked.

Tolerances: float32 1e-5 (forward) and 2e-5 (gradients), absolute and relative; bfloat16
output within 1e-2 and gradients within 2% of each gradient's largest magnitude (the
kernels round P and dS to bf16, as in ``test_triton_backward.py``); LSE 1e-5 in both.
"""

from __future__ import annotations

import pytest
import torch

from ringray.attention import make_layout
from ringray.attention.backends.common import softmax_delta
from ringray.attention.documents import check_documents

triton_forward = pytest.importorskip("ringray.attention.backends.triton_forward")
triton_backward = pytest.importorskip("ringray.attention.backends.triton_backward")
TileConfig = triton_forward.TileConfig

SEQ = 80
DOCUMENTS = [1, 13, 9, 30, 2, 25]
KINDS = ["contiguous", "zigzag", "striped", "balanced", "permutation"]
PAIRS = [(0, 0), (0, 1), (1, 0)]


def doc_of(position: int, documents: list[int] = DOCUMENTS) -> int:
    """The document holding a global position, counted out from the lengths."""
    end = 0
    for index, length in enumerate(documents):
        end += length
        if position < end:
            return index
    raise IndexError(position)


def _tokens(kind: str, q_rank: int, k_rank: int):
    """(q_pos, k_pos, q_doc, k_doc) of one ring step's block pair on a ring of 2."""
    if kind == "permutation":
        perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(3))
        ranks = (perm[:40], perm[40:])
        q_pos, k_pos = ranks[q_rank], ranks[k_rank]
    else:
        layout = make_layout(kind, 2, SEQ, documents=DOCUMENTS)
        q_pos, k_pos = layout.positions(q_rank), layout.positions(k_rank)
    docs = check_documents(DOCUMENTS, SEQ)
    return q_pos, k_pos, docs.ids[q_pos], docs.ids[k_pos]


def _allowed(q_pos, k_pos, causal):
    return torch.tensor([[doc_of(int(i)) == doc_of(int(j)) and (not causal or i >= j)
                          for j in k_pos] for i in q_pos])


def _math64(q, k, v, dout, allowed, scale):
    """Float64 (out, lse, dq, dk, dv) by autograd; out 0 where a row sees no key."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = probs @ v.repeat_interleave(groups, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _inputs(dtype, heads=4, kv_heads=2, head_dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((heads,), (kv_heads,), (kv_heads,), (heads,))
    return [torch.randn(2, h, 40, head_dim, generator=g).to(dtype) for (h,) in shapes]


def _check(kind, causal, q_rank, k_rank, dtype) -> torch.Tensor:
    q, k, v, dout = _inputs(dtype)
    q_pos, k_pos, q_doc, k_doc = _tokens(kind, q_rank, k_rank)
    scale = 64**-0.5
    allowed = _allowed(q_pos, k_pos, causal)
    want_out, want_lse, *want_grads = _math64(q, k, v, dout, allowed, scale)
    docs = {"q_doc": q_doc, "k_doc": k_doc}
    out, lse = triton_forward.block_forward(q, k, v, q_pos, k_pos, causal=causal, scale=scale,
                                            **docs)
    out_tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(out, want_out.float(), atol=out_tol, rtol=out_tol)
    finite = ~torch.isneginf(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite].float(), atol=1e-5, rtol=1e-5)

    grads = triton_backward.block_backward(
        dout, q, k, v, want_lse.float(), softmax_delta(dout, want_out).float(), q_pos, k_pos,
        causal=causal, scale=scale, **docs,
    )
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert torch.isfinite(got).all(), name
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            atol = 2e-2 * want.abs().max().item()
            torch.testing.assert_close(got.double(), want, atol=atol, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
    empty = ~allowed.any(1)  # rows that see no key of this block: exactly nothing
    assert (out[:, :, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()
    assert (grads[0][:, :, empty] == 0).all()
    return empty


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("q_rank", "k_rank"), PAIRS, ids=["own", "0<-1", "1<-0"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_backward_match_float64(kind, q_rank, k_rank, causal) -> None:
    _check(kind, causal, q_rank, k_rank, torch.float32)


@pytest.mark.parametrize("kind", ["zigzag", "balanced", "permutation"])
def test_bfloat16_forward_and_backward(kind) -> None:
    _check(kind, True, 1, 0, torch.bfloat16)


def test_rows_that_see_no_key_are_exactly_empty() -> None:
    """Contiguous, rank 1's queries over rank 0's keys: the queries of documents that start
    on rank 1 see none of rank 0's keys (checked inside ``_check``: lse -inf, output 0, dq
    0); the case must have such rows, in both masks."""
    for causal in (True, False):
        empty = _check("contiguous", causal, 1, 0, torch.float32)
        assert empty.sum() >= 20, empty.sum()


def _visits(q_pos, k_pos, docs, causal):
    """Tile pairs visited for one block pair in 32 × 32 tiles: ``[forward full, forward
    straddling, backward full, backward straddling]``."""
    n = len(q_pos)
    q, k, v, dout = (torch.randn(1, 1, n, 16) for _ in range(4))
    lse, delta = torch.zeros(1, 1, n), torch.zeros(1, 1, n)
    forward = torch.zeros(2, dtype=torch.int32)
    backward = torch.zeros(2, dtype=torch.int32)
    tile = TileConfig(32, 32)
    triton_forward.block_forward(q, k, v, q_pos, k_pos, causal=causal, scale=0.25,
                                 visits=forward, config=tile, **docs)
    triton_backward.block_backward(dout, q, k, v, lse, delta, q_pos, k_pos, causal=causal,
                                   scale=0.25, visits=backward, config=tile, **docs)
    return [*forward.tolist(), *backward.tolist()]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_documents_skip_tiles(causal) -> None:
    """The own block of a contiguous rank (256 tokens, 8 × 8 tiles) holding 64-token
    documents: each document covers 2 × 2 tiles, so with documents the kernels visit only
    the 4 × 4 = 16 tile pairs on the block diagonal (full), or 4 × 3 = 12 (causal: each
    document's 2 diagonal tiles straddle, the one below them is full), against 64 (full) or
    28 full + 8 straddling (causal) without. Both counts are reported."""
    seq, world = 1024, 4
    documents = check_documents([64] * (seq // 64), seq)
    layout = make_layout("contiguous", world, seq)
    pos = layout.positions(1)
    doc_ids = documents.ids[pos]
    without = _visits(pos, pos, {}, causal)
    with_docs = _visits(pos, pos, {"q_doc": doc_ids, "k_doc": doc_ids}, causal)
    print(f"tile pairs visited (forward full, straddling, backward full, straddling), "
          f"{'causal' if causal else 'full'}: without documents {without}, with documents "
          f"{with_docs}")
    assert without == ([28, 8, 28, 8] if causal else [64, 0, 64, 0])
    assert with_docs == ([4, 8, 4, 8] if causal else [16, 0, 16, 0])


def test_cross_document_block_visits_nothing() -> None:
    """A key block whose documents no query shares is skipped tile by tile: zero visits,
    where the causal rule alone would visit every tile, unmasked (the keys all come first)."""
    documents = check_documents([128, 128], 256)
    q_pos, k_pos = torch.arange(128, 256), torch.arange(0, 128)
    docs = {"q_doc": documents.ids[q_pos], "k_doc": documents.ids[k_pos]}
    assert _visits(q_pos, k_pos, {}, True) == [16, 0, 16, 0]
    assert _visits(q_pos, k_pos, docs, True) == [0, 0, 0, 0]
