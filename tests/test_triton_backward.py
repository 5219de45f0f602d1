"""The Triton ring-step backward kernels against the float64 ``reference`` backend, under
``TRITON_INTERPRET=1`` on CPU (set in conftest.py).

The kernels get what a ring gives them: the *final* LSE and ``delta = rowsum(dO * O)`` of
the query rows (here from the float64 reference), and float32 accumulators to add into.
Covered: position patterns of every layout (zigzag halves both ways, striped's shifted
diagonal, contiguous diagonal and below-diagonal blocks, a random permutation), causal and
full, MHA/GQA/MQA (each kv head's dK/dV added atomically by its query heads' programs; one
program stores them under MHA), float32 and bfloat16, head_dim 64 and 80, 40-token blocks
against 32-token tiles, rows that see no key, accumulation over two blocks (dQ arrives by
atomic adds from every key tile), the tile skipping (visited tile pairs are counted, full
and straddling apart), and ``delta``'s own kernel against ``softmax_delta``.

Tolerances: float32 2e-5 absolute and relative. bfloat16: the kernels round P and dS to
bf16 before their products (as flash-attention kernels do), a relative 2^-9 each, summed
over 40 keys or queries: every gradient element within 2% of that gradient's largest
magnitude.
"""

from __future__ import annotations

import pytest
import torch

from ringray.attention import make_layout
from ringray.attention.backends.common import softmax_delta
from ringray.attention.backends.reference import ReferenceBackend
from ringray.attention.pieces import PieceKind

triton_backward = pytest.importorskip("ringray.attention.backends.triton_backward")
TileConfig = triton_backward.TileConfig

SEQ = 2 * 40  # 40 tokens per rank: not a multiple of the 32-token tile
PATTERNS = {  # name: (layout, query rank, key rank)
    "zigzag-0-1": ("zigzag", 0, 1),
    "zigzag-1-0": ("zigzag", 1, 0),
    "striped-0-1": ("striped", 0, 1),
    "contiguous-1-1": ("contiguous", 1, 1),
    "contiguous-1-0": ("contiguous", 1, 0),
    "permutation-0-1": ("permutation", 0, 1),
}
HEADS = {"mha-d64": (4, 4, 64), "gqa-d80": (4, 2, 80), "mqa-d64": (4, 1, 64)}


def _positions(kind: str, q_rank: int, k_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "permutation":
        perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(3))
        ranks = (perm[:40], perm[40:])
        return ranks[q_rank], ranks[k_rank]
    layout = make_layout(kind, 2, SEQ)
    return layout.positions(q_rank), layout.positions(k_rank)


def _inputs(heads, kv_heads, head_dim, dtype, seed=0, sk=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, 40, head_dim, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, sk, head_dim, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, sk, head_dim, generator=g).to(dtype)
    dout = torch.randn(1, heads, 40, head_dim, generator=g).to(dtype)
    return q, k, v, dout


def _reference(q, k, v, dout, q_pos, k_pos, causal, scale):
    """Float64 (out, lse, dq, dk, dv); out is 0 where a row sees no key."""
    ref = ReferenceBackend()
    kind = PieceKind.MASKED if causal else PieceKind.FULL
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, lse = ref.forward(q, k, v, kind=kind, scale=scale, q_pos=q_pos, k_pos=k_pos)
    out = torch.where(torch.isneginf(lse)[..., None], 0.0, out)
    grads = ref.backward(dout, q, k, v, out, lse, kind=kind, scale=scale, q_pos=q_pos,
                         k_pos=k_pos)
    return out, lse, *grads


def _assert_grads_close(got, want, dtype, share_of_largest: float = 2e-2) -> None:
    """float32: 2e-5; otherwise within ``share_of_largest`` of the gradient's largest
    magnitude."""
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), name
        if dtype == torch.float32:
            torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            atol = share_of_largest * w.abs().max().item()
            torch.testing.assert_close(g.double(), w, atol=atol, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _run(pattern, heads, dtype, causal) -> None:
    q_heads, kv_heads, head_dim = HEADS[heads]
    q, k, v, dout = _inputs(q_heads, kv_heads, head_dim, dtype)
    q_pos, k_pos = _positions(*PATTERNS[pattern])
    scale = head_dim**-0.5
    out, lse, *want = _reference(q, k, v, dout, q_pos, k_pos, causal, scale)
    got = triton_backward.block_backward(
        dout, q, k, v, lse.float(), softmax_delta(dout, out).float(), q_pos, k_pos,
        causal=causal, scale=scale,
    )
    _assert_grads_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_causal_backward_matches_reference(pattern, heads, dtype) -> None:
    _run(pattern, heads, dtype, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_full_backward_matches_reference(heads, dtype) -> None:
    _run("permutation-0-1", heads, dtype, causal=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_that_see_no_key_get_zero_gradients(dtype) -> None:
    """Rank 0's queries over rank 1's later keys (contiguous): every row is fully masked,
    lse = -inf. Gradients are exactly 0, never NaN; the same for one such row among many."""
    q, k, v, dout = _inputs(4, 2, 80, dtype)
    q_pos, k_pos = _positions("contiguous", 0, 1)
    lse = torch.full((1, 4, 40), float("-inf"))
    delta = torch.zeros(1, 4, 40)
    dq, dk, dv = triton_backward.block_backward(dout, q, k, v, lse, delta, q_pos, k_pos,
                                                causal=True, scale=0.1)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()

    q_pos, k_pos = _positions("permutation", 0, 1)
    q_pos = q_pos.clone()
    q_pos[5] = -1  # this query precedes every key
    out, lse, *want = _reference(q, k, v, dout, q_pos, k_pos, True, 0.1)
    assert torch.isneginf(lse[:, :, 5]).all()
    got = triton_backward.block_backward(dout, q, k, v, lse.float(),
                                         softmax_delta(dout, out).float(), q_pos, k_pos,
                                         causal=True, scale=0.1)
    assert (got[0][:, :, 5] == 0).all()
    _assert_grads_close(got, want, dtype)


def test_two_blocks_accumulate_into_the_ring_gradients() -> None:
    """Gradients of two K/V blocks added into the same accumulators, with the final LSE
    over both, equal the reference over the joined keys (what a ring relies on)."""
    q, k0, v0, dout = _inputs(4, 2, 64, torch.float32, seed=1)
    _, k1, v1, _ = _inputs(4, 2, 64, torch.float32, seed=2)
    layout = make_layout("zigzag", 2, SEQ)
    q_pos, p0, p1 = layout.positions(1), layout.positions(1), layout.positions(0)
    out, lse, want_dq, want_dk, want_dv = _reference(
        q, torch.cat((k0, k1), 2), torch.cat((v0, v1), 2), dout, q_pos, torch.cat((p0, p1)),
        True, 0.125,
    )
    delta = softmax_delta(dout, out).float()
    dq = torch.zeros(1, 4, 40, 64)
    dks, dvs = [], []
    for k, v, k_pos in ((k0, v0, p0), (k1, v1, p1)):
        dk, dv = torch.zeros(1, 2, 40, 64), torch.zeros(1, 2, 40, 64)
        triton_backward.block_backward(dout, q, k, v, lse.float(), delta, q_pos, k_pos,
                                       causal=True, scale=0.125, dq=dq, dk=dk, dv=dv)
        dks.append(dk)
        dvs.append(dv)
    _assert_grads_close((dq, torch.cat(dks, 2), torch.cat(dvs, 2)),
                        (want_dq, want_dk, want_dv), torch.float32)


def test_striped_step_visits_about_half_the_tiles() -> None:
    """The backward skips the empty tiles of striped's shifted diagonal (queries 4i over
    keys 4j + 1). With 32-query × 64-key tiles, key tile n runs unmasked with query tiles
    m >= 2n + 2 and masked with m = 2n, 2n + 1: 12 full and 8 straddling of 32 pairs."""
    seq, world = 1024, 4
    layout = make_layout("striped", world, seq)
    q, k, v, dout = (torch.randn(1, 1, seq // world, 32) for _ in range(4))
    lse, delta = torch.zeros(1, 1, seq // world), torch.zeros(1, 1, seq // world)
    counts = {}
    for causal in (True, False):
        visits = torch.zeros(2, dtype=torch.int32)
        triton_backward.block_backward(
            dout, q, k, v, lse, delta, layout.positions(0), layout.positions(1),
            causal=causal, scale=0.125, visits=visits, config=TileConfig(32, 64),
        )
        counts[causal] = visits.tolist()
    assert counts == {False: [32, 0], True: [12, 8]}


def test_scores_far_below_zero_give_finite_gradients() -> None:
    """Every score around -128 (lse near -124): a padded key past the block's end (k = 0,
    score 0) would get probability exp(124) = inf in float32 and poison dQ with NaN unless
    the block's last key tile is masked. float32 scores of magnitude 128 carry absolute
    rounding near 1e-5 and dQ cancels (sum of dS near 0 against near-equal keys), so
    closeness is 1e-3 of the largest gradient."""
    g = torch.Generator().manual_seed(7)
    q = 4 + 0.1 * torch.randn(1, 2, 40, 64, generator=g)
    k = -4 + 0.1 * torch.randn(1, 1, 40, 64, generator=g)
    v, dout = torch.randn(1, 1, 40, 64, generator=g), torch.randn(1, 2, 40, 64, generator=g)
    pos = torch.arange(40)
    out, lse, *want = _reference(q, k, v, dout, pos, pos, False, 0.125)
    assert lse.max() < -100
    got = triton_backward.block_backward(dout, q, k, v, lse.float(),
                                         softmax_delta(dout, out).float(), pos, pos,
                                         causal=False, scale=0.125)
    _assert_grads_close(got, want, None, share_of_largest=1e-3)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_delta_kernel_matches_softmax_delta(out_dtype) -> None:
    """``softmax_delta_triton`` reads the ring's transposed ``(batch, seq, heads, d)`` views
    of dO (bfloat16) and O (bfloat16, or the float32 accumulator) as they are and gives
    ``softmax_delta``'s float32 rowsums: both multiply exact float32 products, so only the
    summation order differs (1e-6 of the largest row). Head dim 80 (padded in the kernel),
    70 rows (not a multiple of the kernel's row tile), 2 batches × 3 heads."""
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(2, 70, 3, 80, generator=g).to(torch.bfloat16).transpose(1, 2)
    out = torch.randn(2, 70, 3, 80, generator=g).to(out_dtype).transpose(1, 2)
    got = triton_backward.softmax_delta_triton(dout, out)
    want = softmax_delta(dout, out)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 70) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
