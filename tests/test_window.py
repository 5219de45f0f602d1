"""A sliding window (a query sees keys at most ``window - 1`` positions before it, causal,
within its document) below the ring: the step planner covers exactly the visible pairs, the
tile classifier never skips a visible pair and never calls a tile full that is not, the
transfer plan reads exactly the block pairs with a visible pair, every backend's masked piece
matches float64, and a bad window is refused naming it. The multi-process ring is in
``tests/test_ring_window.py``."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringray.attention import block_work, make_layout
from ringray.attention import pieces as pieces_module
from ringray.attention.backends import BACKENDS
from ringray.attention.backends.common import position_mask
from ringray.attention.documents import check_documents
from ringray.attention.pieces import Piece, PieceKind, plan_rank
from ringray.attention.tiles import classify_tile_pair, tile_ranges
from ringray.attention.transfers import plan_transfers
from ringray.attention.validation import check_window


def visible(q_pos, k_pos, documents: list[int] | None, window: int | None) -> torch.Tensor:
    """``(Sq, Sk)`` bool from the definition, token by token: causal, within the window,
    same document."""
    doc_of = ([d for d, length in enumerate(documents) for _ in range(length)]
              if documents is not None else None)
    return torch.tensor(
        [[j <= i and (window is None or i - j <= window - 1)
          and (doc_of is None or doc_of[i] == doc_of[j]) for j in k_pos.tolist()]
         for i in q_pos.tolist()], dtype=torch.bool).view(len(q_pos), len(k_pos))


def covered(piece: Piece, q_pos, k_pos, documents, window) -> torch.Tensor:
    grid = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int32)
    rows, keys = slice(piece.q_start, piece.q_end), slice(piece.k_start, piece.k_end)
    if piece.kind is PieceKind.FULL:
        grid[rows, keys] = 1
    elif piece.kind is PieceKind.CAUSAL:
        side = piece.q_end - piece.q_start
        grid[rows, keys] = torch.ones(side, side, dtype=torch.int32).tril()
    else:  # a MASKED piece: the kernels' rule (position_mask), from positions and documents
        ids = (torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
               if documents is not None else None)
        mask = position_mask(q_pos[rows], k_pos[keys], torch.device("cpu"), causal=True,
                             q_doc=ids[q_pos[rows]] if ids is not None else None,
                             k_doc=ids[k_pos[keys]] if ids is not None else None,
                             window=window)
        grid[rows, keys] = mask.int()
    return grid


def random_layout(kind: str, world: int, seq: int, documents, rnd: random.Random):
    if kind == "random":
        perm = list(range(seq))
        rnd.shuffle(perm)
        per_rank = seq // world
        return make_layout([perm[r * per_rank:(r + 1) * per_rank] for r in range(world)],
                           world, seq)
    return make_layout(kind, world, seq, documents=documents)


@pytest.fixture(params=["auto", "tiles"])
def planner(request, monkeypatch):
    """The planner as it chooses, or with tiles of 3 tokens (so that a block has many)."""
    if request.param == "tiles":
        monkeypatch.setattr(pieces_module, "PLAN_TILE", 3)
    return request.param


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 5), st.integers(1, 8), st.integers(1, 40), st.booleans(),
       st.sampled_from(["contiguous", "zigzag", "striped", "balanced", "random"]),
       st.randoms(use_true_random=False))
def test_window_plans_cover_exactly(planner, world, half, window, with_documents, kind, rnd):
    """Every visible (query, key) pair once, nothing else, for any layout, documents or
    none, and windows from 1 to past the sequence."""
    seq = 2 * world * half
    documents = None
    if with_documents:
        cuts = sorted(rnd.sample(range(1, seq), rnd.randint(0, min(seq - 1, 8))))
        documents = [b - a for a, b in zip([0, *cuts], [*cuts, seq], strict=True)]
    layout = random_layout(kind, world, seq, documents, rnd)
    docs = check_documents(documents, seq)
    reads = plan_transfers(layout, True, docs, window).reads
    for rank in range(world):
        plan = plan_rank(layout, rank, True, docs, window)
        q_pos = layout.positions(rank)
        for src in range(world):
            k_pos = layout.positions(src)
            grid = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int32)
            for piece in plan.pieces[src]:
                grid += covered(piece, q_pos, k_pos, documents, window)
            want = visible(q_pos, k_pos, documents, window)
            assert torch.equal(grid, want.int()), f"rank {rank} block {src}"
            # The transfer plan sends a block exactly where some pair is visible.
            assert reads[rank][src] == bool(want.any()), f"rank {rank} reads {src}"


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.integers(1, 6), st.booleans(),
       st.randoms(use_true_random=False))
def test_tile_classifier_never_skips_a_visible_pair(window, q_tile, k_tile, with_documents,
                                                    rnd):
    """Tiles that do not run hold no visible pair; tiles that run and do not straddle are
    visible everywhere (so the kernels may compute them unmasked)."""
    seq = 48
    perm = list(range(seq))
    rnd.shuffle(perm)
    q_pos, k_pos = torch.tensor(sorted(perm[:20])), torch.tensor(perm[20:40])
    documents = [10, 1, 20, 17] if with_documents else None
    ids = (torch.repeat_interleave(torch.arange(4), torch.tensor(documents))
           if documents else None)
    q_doc = ids[q_pos].int() if ids is not None else None
    k_doc = ids[k_pos].int() if ids is not None else None
    runs, straddles = classify_tile_pair(tile_ranges(q_pos.int(), q_doc, q_tile),
                                         tile_ranges(k_pos.int(), k_doc, k_tile), True, window)
    want = visible(q_pos, k_pos, documents, window)
    for i in range(runs.shape[0]):
        for j in range(runs.shape[1]):
            pairs = want[i * q_tile:(i + 1) * q_tile, j * k_tile:(j + 1) * k_tile]
            if not runs[i, j]:
                assert not pairs.any(), (i, j)
            elif not straddles[i, j]:
                assert pairs.all(), (i, j)


def test_a_window_beyond_the_sequence_is_no_window():
    """A window as long as the sequence changes nothing: the ring runs without one."""
    assert check_window(None, True, 64) is None
    assert check_window(64, True, 64) is None and check_window(1000, True, 64) is None
    assert check_window(63, True, 64) == 63 and check_window(1, True, 64) == 1


@pytest.mark.parametrize(("window", "causal", "message"), [
    (0, True, "window: expected a positive integer"),
    (-3, True, "window: expected a positive integer"),
    (2.5, True, "window: expected a positive integer"),
    (True, True, "window: expected a positive integer"),
    (4, False, "window: 4 needs causal=True"),
])
def test_a_bad_window_is_refused_naming_it(window, causal, message):
    with pytest.raises(ValueError, match=message):
        check_window(window, causal, 64)
    q = torch.randn(1, 16, 2, 8)
    from ringray.attention import ring_attention

    with pytest.raises(ValueError, match=message):
        ring_attention(q, q, q, causal=causal, window=window)


def test_block_work_counts_visible_pairs_within_the_window():
    documents = [1, 13, 9, 2, 23]
    layout = make_layout("zigzag", 4, 48)
    for window in (1, 3, 10, 47):
        work = block_work(layout, documents, window=window)
        assert work == [[int(visible(layout.positions(r), layout.positions(s), documents,
                                     window).sum()) for s in range(4)] for r in range(4)]


def test_a_small_window_on_contiguous_blocks_reads_only_the_previous_rank():
    """Window 5 over 16-token contiguous blocks: rank r reads its own block and r - 1's
    last 4 keys; one transfer per rank forward, nothing from farther away."""
    layout = make_layout("contiguous", 4, 64)
    plan = plan_transfers(layout, True, None, 5)
    assert [[int(x) for x in row] for row in plan.reads] == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert [plan.counts(r).forward_skipped for r in range(4)] == [2, 2, 2, 3]


@pytest.mark.parametrize("name", ["reference", "sdpa", "triton"])
@pytest.mark.parametrize("window", [1, 4, 13])
@pytest.mark.parametrize("with_documents", [False, True])
def test_masked_piece_with_a_window(name, window, with_documents):
    """A MASKED piece under a window (and documents): float64 math with the mask from the
    definition, forward and backward, rows that see no key included."""
    documents = [3, 17, 1, 9, 20] if with_documents else None
    g = torch.Generator().manual_seed(window)
    q_pos = torch.randperm(50, generator=g)[:18]
    k_pos = torch.randperm(50, generator=g)[:22]
    allowed = visible(q_pos, k_pos, documents, window)
    q = torch.randn(2, 4, 18, 16, generator=g)
    k, v = torch.randn(2, 2, 22, 16, generator=g), torch.randn(2, 2, 22, 16, generator=g)
    dout = torch.randn(2, 4, 18, 16, generator=g)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    scores = (qd @ kd.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(~allowed, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    finite_lse = torch.where(torch.isneginf(want_lse), 0.0, want_lse)
    want_out = torch.exp(scores - finite_lse[..., None]) @ vd.repeat_interleave(2, 1)
    want_out.backward(dout.double())
    mask = {"q_pos": q_pos, "k_pos": k_pos, "causal": True, "window": window}
    if documents is not None:
        ids = torch.repeat_interleave(torch.arange(5), torch.tensor(documents))
        mask.update(q_doc=ids[q_pos], k_doc=ids[k_pos])
    backend = BACKENDS[name]()
    out, lse = backend.forward(q, k, v, kind=PieceKind.MASKED, scale=0.3, **mask)
    torch.testing.assert_close(out.double(), want_out.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse.detach(), atol=2e-5, rtol=2e-5)
    grads = backend.backward(dout, q, k, v, want_out.detach().float(),
                             want_lse.detach().float(), kind=PieceKind.MASKED, scale=0.3,
                             **mask)
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad), strict=True):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
