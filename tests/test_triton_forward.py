"""The Triton ring-step forward kernel against the float64 ``reference`` backend, under
``TRITON_INTERPRET=1`` on CPU (set in conftest.py).

Position patterns of every layout (zigzag halves, striped's shifted diagonal, contiguous,
a random permutation), causal and full, MHA/GQA/MQA, float32, bfloat16 and float16,
head_dim 64 and 80 (padded to 128 inside), a block length that is not a multiple of the
tile, fully masked rows; the fused in-place merge; and the tile skipping (tiles visited are
counted).

Tolerances: float32 1e-5. Half precision: the reference gets the same (rounded) inputs in
float64, so what is left is the kernel's one deliberate rounding, the probabilities cast to
the input dtype before the P·V product (as in every flash kernel): output within 1e-2
absolute and relative for bfloat16 (8-bit mantissa), 2e-3 for float16; the LSE comes from
float32 scores of exact products and stays within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from ringray.attention import make_layout
from ringray.attention.backends.reference import ReferenceBackend
from ringray.attention.pieces import PieceKind

triton_forward = pytest.importorskip("ringray.attention.backends.triton_forward")
TileConfig = triton_forward.TileConfig

SEQ = 2 * 40  # 40 tokens per rank: not a multiple of the 32-token tile


def _positions(kind: str, q_rank: int, k_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "permutation":
        perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(3))
        ranks = (perm[:40], perm[40:])
        return ranks[q_rank], ranks[k_rank]
    layout = make_layout(kind, 2, SEQ)
    return layout.positions(q_rank), layout.positions(k_rank)


def _reference(q, k, v, q_pos, k_pos, causal, scale):
    kind = PieceKind.MASKED if causal else PieceKind.FULL
    out, lse = ReferenceBackend().forward(
        q.double(), k.double(), v.double(), kind=kind, scale=scale, q_pos=q_pos, k_pos=k_pos
    )
    return torch.where(torch.isneginf(lse)[..., None], 0.0, out), lse


def _inputs(heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, 40, head_dim, generator=g).to(dtype)
    k = torch.randn(2, kv_heads, 40, head_dim, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, 40, head_dim, generator=g).to(dtype)
    return q, k, v


OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
HEADS = pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                                [(4, 4, 64), (4, 2, 80), (4, 1, 64)],
                                ids=["mha-d64", "gqa-d80", "mqa-d64"])
CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
KINDS = pytest.mark.parametrize("kind", ["zigzag", "striped", "contiguous", "permutation"])


def _check_forward(kind, causal, heads, kv_heads, head_dim, dtype, q_rank, k_rank) -> None:
    q, k, v = _inputs(heads, kv_heads, head_dim, dtype)
    q_pos, k_pos = _positions(kind, q_rank, k_rank)
    scale = head_dim**-0.5
    out, lse = triton_forward.block_forward(q, k, v, q_pos, k_pos, causal=causal, scale=scale)
    want_out, want_lse = _reference(q, k, v, q_pos, k_pos, causal, scale)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(out, want_out.float(), atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    finite = ~torch.isneginf(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite].float(), atol=1e-5, rtol=1e-5)


@HEADS
@CAUSAL
@KINDS
@pytest.mark.parametrize(("q_rank", "k_rank"), [(0, 0), (0, 1), (1, 0)])
def test_forward_matches_reference(kind, causal, heads, kv_heads, head_dim, q_rank,
                                   k_rank) -> None:
    _check_forward(kind, causal, heads, kv_heads, head_dim, torch.float32, q_rank, k_rank)


@HEADS
@CAUSAL
@KINDS
@pytest.mark.parametrize(("q_rank", "k_rank"), [(0, 1), (1, 0)])
def test_bfloat16_forward_matches_reference(kind, causal, heads, kv_heads, head_dim, q_rank,
                                            k_rank) -> None:
    _check_forward(kind, causal, heads, kv_heads, head_dim, torch.bfloat16, q_rank, k_rank)


@KINDS
def test_float16_forward_matches_reference(kind) -> None:
    _check_forward(kind, True, 4, 2, 80, torch.float16, 1, 0)


def test_bfloat16_dot_is_not_reading_raw_bits() -> None:
    """Pins the interpreter workaround (triton-lang/triton#11584): one bf16 tile of full
    attention is right. Without the upcast the output is around 1e9."""
    q, k, v = _inputs(1, 1, 64, torch.bfloat16, seed=5)
    pos = torch.arange(40)
    out, _ = triton_forward.block_forward(q, k, v, pos, pos, causal=False, scale=0.125)
    want, _ = _reference(q, k, v, pos, pos, False, 0.125)
    torch.testing.assert_close(out, want.float(), atol=1e-2, rtol=1e-2)


def test_contiguous_future_block_is_fully_masked() -> None:
    """Rank 0 attending to rank 1's (later) block sees no key: lse -inf, output 0."""
    q, k, v = _inputs(4, 2, 64, torch.float32)
    q_pos, k_pos = _positions("contiguous", 0, 1)
    out, lse = triton_forward.block_forward(q, k, v, q_pos, k_pos, causal=True, scale=0.125)
    assert torch.isneginf(lse).all() and (out == 0).all()


def test_fused_merge_equals_attention_over_both_blocks() -> None:
    """Two ring steps merged in place equal one reference call over the joined keys."""
    q, k0, v0 = _inputs(4, 2, 64, torch.float32, seed=1)
    _, k1, v1 = _inputs(4, 2, 64, torch.float32, seed=2)
    layout = make_layout("zigzag", 2, SEQ)
    q_pos, p0, p1 = layout.positions(1), layout.positions(1), layout.positions(0)
    out = torch.zeros(2, 4, 40, 64)
    lse = torch.full((2, 4, 40), float("-inf"))
    for k, v, k_pos in ((k0, v0, p0), (k1, v1, p1)):
        triton_forward.block_forward(q, k, v, q_pos, k_pos, causal=True, scale=0.125,
                                     out=out, lse=lse)
    want_out, want_lse = _reference(q, torch.cat((k0, k1), 2), torch.cat((v0, v1), 2),
                                    q_pos, torch.cat((p0, p1)), True, 0.125)
    torch.testing.assert_close(out, want_out.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-5, rtol=1e-5)


def test_striped_step_visits_about_half_the_tiles() -> None:
    """Striped's shifted diagonal (rank 0's queries, positions 4i, over rank 1's keys,
    4j + 1) is a strictly lower causal triangle: of the 8 × 8 tile pairs of a full step the
    kernel computes the 28 below the diagonal unmasked and the 8 on it masked, and never
    visits the 28 above it."""
    seq, world = 1024, 4
    layout = make_layout("striped", world, seq)
    q, k, v = (torch.randn(1, 1, seq // world, 64) for _ in range(3))
    counts = {}
    for causal in (True, False):
        visits = torch.zeros(2, dtype=torch.int32)
        triton_forward.block_forward(q, k, v, layout.positions(0), layout.positions(1),
                                     causal=causal, scale=0.125, visits=visits,
                                     config=TileConfig(32, 32))
        counts[causal] = visits.tolist()
    assert counts == {False: [64, 0], True: [28, 8]}


def test_full_attention_masks_only_the_short_last_tile(monkeypatch) -> None:
    """Without a mask (full attention, no documents) the kernel builds no tile lists: the
    loop bounds are arithmetic, every key tile is full but the one that runs past the end
    of the 40-key block, which is masked (one each per query tile and head)."""
    from ringray.attention.backends import triton_tiles

    def no_lists(*args, **kwargs):
        raise AssertionError("tile lists built for an unmasked block pair")

    monkeypatch.setattr(triton_tiles, "build_tile_lists", no_lists)
    q, k, v = _inputs(4, 2, 64, torch.float32)
    pos = torch.arange(40)
    visits = torch.zeros(2, dtype=torch.int32)
    out, _ = triton_forward.block_forward(q, k, v, pos, pos, causal=False, scale=0.125,
                                          visits=visits, config=TileConfig(32, 32))
    assert visits.tolist() == [2 * 2 * 4, 2 * 2 * 4]  # 2 query tiles × batch 2 × 4 heads
    want, _ = _reference(q, k, v, pos, pos, False, 0.125)
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
