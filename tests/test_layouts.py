"""Layouts map global tokens to (rank, local index); shard/unshard are inverse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ring_cases import SEED_FOLD, random_permutation_layout

from ringray.attention import causal_work, make_layout
from ringray.attention.layouts import Layout, seq_len_divisor


def test_zigzag_holds_chunks_r_and_2n_minus_1_minus_r():
    lay = make_layout("zigzag", 4, 16)
    assert [lay.positions(r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]
    ]


def test_striped_puts_token_t_on_rank_t_mod_n():
    lay = make_layout("striped", 4, 12)
    assert [lay.positions(r).tolist() for r in range(4)] == [
        [0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]
    ]


def test_contiguous_gives_each_rank_one_slice():
    lay = make_layout("contiguous", 3, 9)
    assert [lay.positions(r).tolist() for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_seed_token_fold_is_accepted_as_an_explicit_permutation():
    lay = make_layout(SEED_FOLD, 4, 16)
    assert lay.kind == "custom"
    assert lay.positions(2).tolist() == [2, 5, 10, 13]
    assert all(lay.is_regular(r) for r in range(4))


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_then_unshard_is_identity(kind, world):
    seq = seq_len_divisor(kind, world) * 3
    lay = make_layout(kind, world, seq)
    x = torch.randn(2, seq, 3, 5)
    shards = [lay.shard(x, r) for r in range(world)]
    assert all(s.shape == (2, seq // world, 3, 5) for s in shards)
    torch.testing.assert_close(lay.unshard(shards), x, rtol=0, atol=0)
    for r, s in enumerate(shards):  # a shard holds exactly its positions
        torch.testing.assert_close(s, x[:, lay.positions(r)], rtol=0, atol=0)


def test_shard_along_another_dim():
    lay = make_layout("zigzag", 2, 8)
    x = torch.arange(2 * 3 * 8).view(2, 3, 8)
    assert torch.equal(lay.unshard([lay.shard(x, r, dim=2) for r in range(2)], dim=2), x)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.randoms(use_true_random=False))
def test_any_permutation_round_trips(world, per_rank, rnd):
    lay = random_permutation_layout(world, per_rank, rnd)
    seq = lay.seq_len
    x = torch.randn(1, seq, 2)
    torch.testing.assert_close(lay.unshard([lay.shard(x, r) for r in range(world)]), x)
    runs = [run for r in range(world) for run in lay.runs(r)]
    assert sum(run.length for run in runs) == seq


@pytest.mark.parametrize(
    "args, message",
    [
        (("zigzag", 4, 12), "multiple of 8"),
        (("striped", 3, 10), "multiple of 3"),
        (("contiguous", 2, 0), "positive multiple"),
        (("spiral", 2, 8), "unknown kind 'spiral'"),
        (([[0, 1], [2]], 2, 3), "same number of tokens"),
        (([[0, 1], [1, 2]], 2, 4), "permutation of range(4)"),
        (([[0, 1]], 2, 4), "for 1 ranks, expected world_size=2"),
        (("zigzag", 0, 4), "world_size must be >= 1"),
    ],
)
def test_bad_layouts_name_the_problem(args, message):
    with pytest.raises(ValueError, match="layout: .*" + _escape(message)):
        make_layout(*args)


def test_layout_reports_the_divisor_it_needs():
    assert make_layout("zigzag", 4, 16).divisor == 8
    assert make_layout("striped", 3, 9).divisor == 3
    assert make_layout(SEED_FOLD, 4, 16).divisor == 16
    assert make_layout("zigzag", 4, 16) is make_layout("zigzag", 4, 16)  # shared, immutable


def test_layout_object_must_match_the_ring():
    lay = make_layout("zigzag", 4, 16)
    assert make_layout(lay, 4, 16) is lay
    with pytest.raises(ValueError, match="world_size=4, seq_len=16 but the call needs"):
        make_layout(lay, 2, 16)


def test_causal_work_and_theoretical_imbalance():
    # Token p sees p + 1 keys; contiguous over 4 ranks of 4 tokens: 10, 26, 42, 58.
    assert causal_work(make_layout("contiguous", 4, 16)) == [10, 26, 42, 58]
    zigzag = causal_work(make_layout("zigzag", 4, 16))
    assert max(zigzag) == min(zigzag) == 34  # zigzag is perfectly balanced
    assert sum(causal_work(make_layout("striped", 4, 16))) == 16 * 17 // 2


def test_fingerprint_tells_layouts_apart():
    a = make_layout("zigzag", 4, 16)
    assert a.fingerprint == make_layout("zigzag", 4, 16).fingerprint
    assert a.fingerprint != make_layout("striped", 4, 16).fingerprint
    assert a.fingerprint != make_layout(SEED_FOLD, 4, 16).fingerprint
    assert isinstance(a, Layout) and 0 <= a.fingerprint < 2**31


def _escape(text: str) -> str:
    import re

    return re.escape(text)
