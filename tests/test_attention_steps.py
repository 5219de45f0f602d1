"""The step planner covers exactly the causally visible query-key pairs, once each, and
sends zigzag/striped/contiguous work to fused (unmasked or causal) kernel calls only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ring_cases import SEED_FOLD, random_permutation_layout

from ringray.attention import make_layout
from ringray.attention.layouts import seq_len_divisor
from ringray.attention.pieces import Piece, PieceKind, plan_rank


def covered(piece: Piece, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The (local row, local key) pairs a piece computes, as a bool matrix."""
    grid = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int32)
    rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
    n_rows, n_keys = piece.q_end - piece.q_start, piece.k_end - piece.k_start
    if piece.kind is PieceKind.FULL:
        grid[rows, keys] = 1
    elif piece.kind is PieceKind.CAUSAL:
        assert n_rows == n_keys, "a CAUSAL piece is square"
        grid[rows, keys] = torch.ones(n_rows, n_keys, dtype=torch.int32).tril()
    else:
        grid[rows, keys] = (q_pos[rows, None] >= k_pos[None, keys]).int()
    return grid


def assert_exact_cover(layout, causal: bool) -> list[Piece]:
    pieces_seen = []
    for rank in range(layout.world_size):
        plan = plan_rank(layout, rank, causal)
        q_pos = layout.positions(rank)
        for src in range(layout.world_size):
            k_pos = layout.positions(src)
            grid = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int32)
            for piece in plan.pieces[src]:
                assert 0 <= piece.q_start < piece.q_end <= len(q_pos)
                assert 0 <= piece.k_start < piece.k_end <= len(k_pos)
                grid += covered(piece, q_pos, k_pos)
                pieces_seen.append(piece)
            want = q_pos[:, None] >= k_pos[None, :] if causal else torch.ones_like(grid).bool()
            assert torch.equal(grid, want.int()), f"rank {rank} block {src}: missed or doubled"
    return pieces_seen


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("blocks", [1, 3, 7])
def test_builtin_layouts_are_covered_exactly_without_masks(kind, world, blocks):
    seq = seq_len_divisor(kind, world) * blocks
    pieces = assert_exact_cover(make_layout(kind, world, seq), causal=True)
    assert all(p.kind is not PieceKind.MASKED for p in pieces)


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped"])
def test_full_attention_is_one_call_per_block(kind):
    lay = make_layout(kind, 4, 32)
    for rank in range(4):
        plan = plan_rank(lay, rank, causal=False)
        assert all(len(block) == 1 and block[0].kind is PieceKind.FULL for block in plan.pieces)


def test_seed_fold_is_covered_exactly():
    assert_exact_cover(make_layout(SEED_FOLD, 4, 16), causal=True)


def test_zigzag_steps_are_few_large_calls():
    """Off-diagonal zigzag blocks are one FULL call; the own block is two causal squares
    and one full square."""
    lay = make_layout("zigzag", 4, 64)
    plan = plan_rank(lay, 1, causal=True)
    assert [len(b) for b in plan.pieces] == [1, 3, 1, 1]
    kinds = sorted(p.kind.value for p in plan.pieces[1])
    assert kinds == ["causal", "causal", "full"]


def test_striped_shifted_diagonal_leaves_first_row_empty():
    """When the key stripe is ahead of the query stripe, query 0 sees no key in that block:
    the plan says so by starting the causal square one row down."""
    lay = make_layout("striped", 4, 32)
    plan = plan_rank(lay, 0, causal=True)
    (piece,) = plan.pieces[1]
    assert (piece.kind, piece.q_start, piece.q_end, piece.k_start, piece.k_end) == (
        PieceKind.CAUSAL, 1, 8, 0, 7
    )


def test_contiguous_skips_blocks_from_the_future():
    lay = make_layout("contiguous", 4, 32)
    plan = plan_rank(lay, 1, causal=True)
    assert plan.pieces[2] == () and plan.pieces[3] == ()
    assert plan.pairs_per_block == (64, 36, 0, 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.randoms(use_true_random=False))
def test_random_permutations_are_covered_exactly(world, per_rank, rnd):
    assert_exact_cover(random_permutation_layout(world, per_rank, rnd), causal=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 5), st.integers(0, 3))
def test_arithmetic_runs_of_any_stride_are_covered_exactly(world, runs, run_len, shift):
    """Custom layouts built from strided runs exercise the run-against-run planner."""
    seq = world * runs * run_len
    order = torch.arange(seq).view(run_len, world * runs).t().roll(shift, 0).flatten()
    per_rank = seq // world
    layout = make_layout([order[r * per_rank:(r + 1) * per_rank].tolist() for r in range(world)],
                         world, seq)
    assert_exact_cover(layout, causal=True)
