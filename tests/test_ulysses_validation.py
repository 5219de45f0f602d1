"""Bad calls on a ring × Ulysses grid raise ValueError on every rank of the grid, naming the
argument, before any block or all-to-all moves; none of them leaves a rank waiting.

The failing rank is chosen so that some ranks share no group with it (rank 3 of a 2 × 2
grid is neither in rank 0's ring nor in its Ulysses group): the two-stage agreement (Ulysses
group, then ring) must still carry its failure there. All scenarios run in one launch of
four gloo processes, in order, ending with a good call (the grid still works after them);
the launch is bounded by a timeout, so a hang is a failure, not a stuck test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_gloo_ranks

from ringray.attention import make_layout, ring_attention
from ringray.attention.ulysses import check_ulysses_heads, grid_groups

SEQ = 32
RING, ULYSSES = 2, 2


def test_heads_that_do_not_split_name_the_numbers():
    with pytest.raises(ValueError, match=r"^q: 6 query heads do not split over ulysses=4 "
                                         r"ranks; use a multiple of 4 query heads"):
        check_ulysses_heads(6, 2, 4)
    with pytest.raises(ValueError, match=r"^k: 3 kv heads neither split over nor replicate "
                                         r"evenly onto ulysses=2 ranks"):
        check_ulysses_heads(6, 3, 2)
    assert check_ulysses_heads(8, 4, 2) == 1  # split: 2 kv heads per rank
    assert check_ulysses_heads(8, 2, 4) == 2  # repeated twice, one per rank
    assert check_ulysses_heads(8, 1, 4) == 4


def test_ulysses_group_without_torch_distributed_is_refused():
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="ulysses_group: a process group was given but "
                                         "torch.distributed is not initialised"):
        ring_attention(q, q, q, ulysses_group=object())


def _inputs(rank: int, heads=(4, 2, 2), seq=SEQ):
    torch.manual_seed(0)  # the same global data on every rank
    layout = make_layout("zigzag", RING * ULYSSES, seq, ulysses=ULYSSES)
    return [layout.shard(torch.randn(1, seq, h, 8), rank) for h in heads]


def _attempt(q, k, v, group, ulysses_group, **kwargs) -> str:
    try:
        ring_attention(q, k, v, group, ulysses_group=ulysses_group, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def grid_scenarios(rank: int, world: int) -> dict[str, str]:
    """Every scenario on this rank, in order: scenario -> the error it raised (or none)."""
    ring, ulysses = grid_groups(ULYSSES)
    # Rings that pair ranks of different ulysses indices (created collectively by all ranks).
    pairs = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    crossed_ring = pairs[0] if rank in (0, 3) else pairs[1]
    q, k, v = _inputs(rank)
    seen = {}
    bad_q = q[:, :, :3] if rank == 3 else q  # 3 query heads over 2 ranks, on rank 3 only
    seen["bad q heads on one rank"] = _attempt(bad_q, k[:, :, :1], v[:, :, :1], ring, ulysses)
    q6 = torch.randn(1, q.shape[1], 6, 8)
    kv = torch.randn(1, q.shape[1], 3 if rank == 0 else 2, 8)  # 3 kv heads: on rank 0 only
    seen["bad kv heads on one rank"] = _attempt(q6, kv, kv, ring, ulysses)
    documents = [8, 24] if rank != 2 else [8, 23]
    seen["bad documents on one rank"] = _attempt(q, k, v, ring, ulysses, documents=documents)
    short = _inputs(rank, seq=SEQ // 2) if rank == 1 else (q, k, v)
    seen["ranks disagree on local_seq"] = _attempt(*short, ring, ulysses)
    seen["transposed groups"] = _attempt(q, k, v, ulysses, ring)  # rows and columns swapped
    seen["rings across ulysses indices"] = _attempt(q, k, v, crossed_ring, ulysses)
    swapped = (ulysses, ring) if rank == 0 else (ring, ulysses)  # rank 0 swaps its groups
    seen["one rank swaps its groups"] = _attempt(q, k, v, *swapped)
    # Ranks 2 and 3 forget ulysses_group: each of their rings meets a rank with it.
    seen["ranks disagree on ulysses"] = _attempt(q, k, v, ring, ulysses if rank < 2 else None)
    out = ring_attention(q, k, v, ring, ulysses_group=ulysses)
    seen["a good call afterwards"] = f"ok {tuple(out.shape)}"
    return seen


_results: list[dict[str, str]] = []


def results() -> list[dict[str, str]]:
    if not _results:
        _results.extend(run_gloo_ranks(RING * ULYSSES, grid_scenarios, timeout_seconds=300))
    return _results


def _grid_rejected(rank: int, argument: str) -> str:
    ring_index, ulysses_index = divmod(rank, ULYSSES)
    return (f"ring_attention: rank {rank} of the ring x ulysses grid (ring index {ring_index}, "
            f"ulysses index {ulysses_index}) rejected its inputs ({argument}) (its own error "
            f"says why); no block or all-to-all was sent")


@pytest.mark.parametrize("scenario, bad_rank, own_error, argument", [
    ("bad q heads on one rank", 3, "q: 3 query heads do not split over ulysses=2 ranks", "q"),
    ("bad kv heads on one rank", 0,
     "k: 3 kv heads neither split over nor replicate evenly onto ulysses=2 ranks", "k"),
    ("bad documents on one rank", 2, "documents: the 2 lengths sum to 31 but the global "
                                     "sequence has 32 tokens", "documents"),
    ("one rank swaps its groups", 0, "ulysses_group: its ranks [0, 2] are not consecutive",
     "ulysses_group"),
])
def test_one_bad_rank_fails_every_rank_of_the_grid(scenario, bad_rank, own_error, argument):
    """The bad rank raises its own error; every other rank (ring peer, Ulysses peer, and
    the rank that shares no group with it) says which rank rejected which argument."""
    messages = [r[scenario] for r in results()]
    assert messages[bad_rank].startswith(own_error), messages[bad_rank]
    for rank in set(range(RING * ULYSSES)) - {bad_rank}:
        assert messages[rank] == _grid_rejected(bad_rank, argument), messages[rank]


@pytest.mark.parametrize("scenario, message", [
    ("ranks disagree on local_seq", "ranks disagree on local_seq (values from 4 to 8); every "
                                    "rank of the ring x ulysses grid must pass the same"),
    ("transposed groups", "ulysses_group: its ranks"),
    ("rings across ulysses indices", "group: the ring's ranks"),
])
def test_grid_wide_mismatches_fail_on_every_rank(scenario, message):
    messages = [r[scenario] for r in results()]
    assert all(message in m for m in messages), messages


def test_ranks_without_ulysses_group_are_told_the_degrees_differ():
    """Ranks 2 and 3 pass no ulysses_group: their rings meet ranks 0 and 1, which pass one,
    and every rank names the ulysses degree (1 against 2) rather than hanging."""
    messages = [r["ranks disagree on ulysses"] for r in results()]
    assert all("ranks disagree on ulysses (values from 1 to 2)" in m for m in messages), messages


def test_transposed_groups_name_the_rule():
    message = results()[1]["transposed groups"]
    assert message == ("ulysses_group: its ranks [1, 3] are not consecutive; ranks are "
                       "numbered ring_index x 2 + ulysses_index, so a Ulysses group is a run "
                       "of 2 consecutive ranks")
    crossed = results()[0]["rings across ulysses indices"]
    assert crossed.startswith("group: the ring's ranks [0, 3] should be [0, 2], the ranks "
                              "that share this rank's ulysses index 0"), crossed


def test_the_grid_still_works_after_every_rejected_call():
    assert all(r["a good call afterwards"] == "ok (1, 8, 4, 8)" for r in results())
