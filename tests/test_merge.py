"""The online-softmax merge equals attention over the union of key sets (float64 math) and
never produces NaN when a side saw no key."""

from __future__ import annotations

import torch

from ringray.attention import merge
from ringray.attention.merge import merge_into


def attention64(q, k, v):
    scores = q.double() @ k.double().transpose(-1, -2)
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ v.double(), lse


def test_merge_of_two_key_sets_equals_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    out_a, lse_a = attention64(q, k[:, :, :3], v[:, :, :3])
    out_b, lse_b = attention64(q, k[:, :, 3:], v[:, :, 3:])
    want_out, want_lse = attention64(q, k, v)
    out, lse = merge(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    torch.testing.assert_close(out.double(), want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-6)


def test_empty_side_leaves_the_other_unchanged_and_both_empty_stay_zero():
    out_a = torch.randn(1, 1, 4, 8)
    lse_a = torch.tensor([[[0.5, float("-inf"), 2.0, float("-inf")]]])
    out_a[0, 0, 1] = 0
    out_a[0, 0, 3] = 0
    out_b = torch.zeros(1, 1, 4, 8)
    lse_b = torch.full((1, 1, 4), float("-inf"))
    out_b[0, 0, 1] = 3.0
    lse_b[0, 0, 1] = 1.0
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0, 0], out_a[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 1], torch.full((8,), 3.0))
    assert lse[0, 0, 3] == float("-inf") and (out[0, 0, 3] == 0).all()

    acc_out, acc_lse = out_a.clone(), lse_a.clone()
    merge_into(acc_out, acc_lse, out_b, lse_b)
    torch.testing.assert_close(acc_out, out)
    torch.testing.assert_close(acc_lse, lse)


def test_merge_into_views_updates_the_underlying_accumulator():
    acc = torch.zeros(1, 2, 6, 4)
    lse = torch.full((1, 2, 6), float("-inf"))
    part = torch.ones(1, 2, 3, 4)
    merge_into(acc[:, :, 2:5], lse[:, :, 2:5], part, torch.zeros(1, 2, 3))
    assert (acc[:, :, 2:5] == 1).all() and (acc[:, :, :2] == 0).all()
    assert (lse[:, :, 2:5] == 0).all() and torch.isneginf(lse[:, :, 5]).all()
