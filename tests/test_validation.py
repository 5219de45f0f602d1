"""Bad calls raise ValueError naming the argument, before any block is sent, and a bad call
on one rank never leaves the other ranks of the ring waiting."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import RanksFailed, run_gloo_ranks

from ringray.attention import make_layout, ring_attention


def qkv(batch=1, seq=8, hq=4, hkv=2, d=8, dtype=torch.float32):
    return (torch.randn(batch, seq, hq, d, dtype=dtype),
            torch.randn(batch, seq, hkv, d, dtype=dtype),
            torch.randn(batch, seq, hkv, d, dtype=dtype))


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda q, k, v: (q[0], k, v), r"q: expected 4 dims"),
        (lambda q, k, v: (q, k.double(), v), r"k: dtype torch.float64 differs from q's"),
        (lambda q, k, v: (q, k, v[:, :, :1]), r"v: shape .* must equal k's shape"),
        (lambda q, k, v: (q, k[:, :4], v[:, :4]), r"k: shape .* must match q"),
        (lambda q, k, v: (q, k[..., :4], v[..., :4]), r"k: shape .* must match q"),
        (lambda q, k, v: (q[:, :, :3], k, v), r"k: kv_heads=2 must divide q_heads=3"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), r"q: dtype torch.int32 is not supported"),
        (lambda q, k, v: ("q", k, v), r"q: expected a torch.Tensor, got str"),
        (lambda q, k, v: (q[:, :0], k[:, :0], v[:, :0]), r"q: every dimension must be non-empty"),
    ],
)
def test_bad_tensors_name_the_argument(make_args, message):
    with pytest.raises(ValueError, match=message):
        ring_attention(*make_args(*qkv()))


def test_bad_options_name_the_option():
    q, k, v = qkv(seq=7)
    with pytest.raises(ValueError, match=r"layout: seq_len=7 cannot be split by layout "
                                         r"'zigzag' over 1 ranks; it must be a positive "
                                         r"multiple of 2"):
        ring_attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale: must be a positive finite number"):
        ring_attention(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="backend: unknown backend 'flsh'"):
        ring_attention(q, k, v, backend="flsh")
    with pytest.raises(ValueError, match="layout: got a layout for world_size=2"):
        ring_attention(q, k, v, layout=make_layout("zigzag", 2, 16))


def test_single_process_call_needs_no_process_group():
    q, k, v = qkv()
    out = ring_attention(q, k, v, layout="striped")
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def one_rank_passes_bad_heads(rank: int, world: int) -> str:
    q, k, v = qkv()
    if rank == 1:
        q = q[:, :, :3]  # 3 query heads over 2 kv heads
    try:
        ring_attention(q, k, v, layout="zigzag")
    except ValueError as exc:
        return str(exc)
    return "no error"


def ranks_disagree_on_sequence(rank: int, world: int) -> str:
    q, k, v = qkv(seq=8 if rank != 2 else 6)
    try:
        ring_attention(q, k, v, layout="striped")
    except ValueError as exc:
        return str(exc)
    return "no error"


def good_call_after_bad_call(rank: int, world: int) -> float:
    """The ring is still usable after every rank rejected a call."""
    one_rank_passes_bad_heads(rank, world)
    torch.manual_seed(0)  # same global data on every rank
    layout = make_layout("zigzag", world, 8 * world)
    q, k, v = (layout.shard(t, rank) for t in qkv(seq=8 * world))
    return float(ring_attention(q, k, v, layout=layout).sum())


def test_bad_shape_on_one_rank_raises_there_and_on_the_others_without_hanging():
    messages = run_gloo_ranks(3, one_rank_passes_bad_heads, timeout_seconds=90)
    assert "k: kv_heads=2 must divide q_heads=3" in messages[1]
    for rank in (0, 2):
        assert "rank 1 of the ring rejected its inputs" in messages[rank]


def test_ranks_that_disagree_on_shapes_all_raise():
    messages = run_gloo_ranks(4, ranks_disagree_on_sequence, timeout_seconds=90)
    assert all("ranks disagree on local_seq (values from 6 to 8)" in m for m in messages)


def test_ring_still_works_after_a_rejected_call():
    sums = run_gloo_ranks(2, good_call_after_bad_call, timeout_seconds=90)
    assert all(isinstance(s, float) for s in sums)


def hangs_forever(rank: int, world: int) -> None:
    if rank == 0:
        import time

        time.sleep(3600)


def test_harness_reports_a_hang_instead_of_waiting():
    """The multi-process harness itself is bounded: a stuck rank is a failure, not a hang."""
    with pytest.raises(RanksFailed, match=r"ranks \[0\] did not finish within 8s"):
        run_gloo_ranks(2, hangs_forever, timeout_seconds=8)


def environment_and_parent(rank: int, world: int) -> tuple[str | None, int, bool]:
    import os
    import sys

    return os.environ.get("RINGRAY_TEST_MARK"), os.getppid(), "ringray.train" in sys.modules


def test_ranks_fork_from_one_server_and_take_the_callers_environment(monkeypatch):
    """The ranks come from one fork server that imported the training stack (no rank imports
    it afresh), and each sees the caller's environment as it is at the call, not as it was
    when the server started."""
    monkeypatch.setenv("RINGRAY_TEST_MARK", "first")
    first = run_gloo_ranks(2, environment_and_parent)
    monkeypatch.setenv("RINGRAY_TEST_MARK", "second")
    second = run_gloo_ranks(2, environment_and_parent)
    assert [mark for mark, _, _ in first] == ["first", "first"]
    assert [mark for mark, _, _ in second] == ["second", "second"]
    parents = {parent for _, parent, _ in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # the fork server, not this test
    assert all(preloaded for _, _, preloaded in first + second)


def test_bad_documents_name_the_argument():
    q, k, v = qkv(seq=8)
    with pytest.raises(ValueError, match=r"documents: length 1 is 0; every document length "
                                         r"must be a positive integer"):
        ring_attention(q, k, v, documents=[4, 0, 4])
    with pytest.raises(ValueError, match=r"documents: the 2 lengths sum to 9 but the global "
                                         r"sequence has 8 tokens"):
        ring_attention(q, k, v, documents=[4, 5])


def ranks_pass_documents(rank: int, world: int, lengths_by_rank: list) -> str:
    """Each rank passes its own document lengths (a good call needs them all equal)."""
    torch.manual_seed(0)
    layout = make_layout("zigzag", world, 8 * world)
    q, k, v = (layout.shard(t, rank) for t in qkv(seq=8 * world))
    try:
        ring_attention(q, k, v, layout=layout, documents=lengths_by_rank[rank])
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "lengths_by_rank, own_error",
    [
        # rank 1's lengths sum to 23 for a 24-token sequence
        ([[8, 16], [8, 15], [8, 16]], "documents: the 2 lengths sum to 23 but the global "
                                      "sequence has 24 tokens"),
        # rank 2 gives a length of 0
        ([[8, 16], [8, 16], [8, 0, 16]], "documents: length 1 is 0"),
    ],
)
def test_bad_documents_on_one_rank_fail_on_every_rank(lengths_by_rank, own_error):
    """The rank with bad lengths raises its own error (naming documents); the others say
    which rank rejected which argument. Nobody hangs and no block is sent."""
    messages = run_gloo_ranks(3, ranks_pass_documents, lengths_by_rank, timeout_seconds=90)
    bad = next(r for r, lengths in enumerate(lengths_by_rank) if lengths != [8, 16])
    assert own_error in messages[bad]
    for rank in set(range(3)) - {bad}:
        assert (f"rank {bad} of the ring rejected its inputs (documents)" in messages[rank]
                and "no block was sent" in messages[rank]), messages[rank]


@pytest.mark.parametrize("lengths_by_rank", [
    [[8, 16], [16, 8], [8, 16]],  # valid everywhere, but different
    [[8, 16], None, [8, 16]],  # one rank forgot them
])
def test_ranks_that_disagree_on_documents_all_raise(lengths_by_rank):
    messages = run_gloo_ranks(3, ranks_pass_documents, lengths_by_rank, timeout_seconds=90)
    assert all("ranks disagree on documents; every rank of the ring must pass the same" in m
               for m in messages), messages
