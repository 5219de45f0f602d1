"""The ring × Ulysses grid layout and the all-to-all packing, without processes.

Grid rank ``ring_index * U + ulysses_index`` holds sub-shard ``ulysses_index`` of ring member
``ring_index``'s chunk; the packing functions, run through a simulated all-to-all (block j
of rank i's buffer arrives as block i on rank j), turn each rank's sub-shard with all heads
into the member's whole chunk with H/U heads, and back.
"""

from __future__ import annotations

import pytest
import torch

from ringray.attention import make_layout
from ringray.attention.layouts import seq_len_divisor
from ringray.attention.ulysses import (
    pack_for_heads,
    pack_for_sequence,
    unpack_heads,
    unpack_sequence,
)

GRIDS = [(1, 2), (2, 2), (3, 2), (1, 4), (2, 4)]


def test_zigzag_grid_cuts_each_ring_chunk_into_consecutive_sub_shards():
    lay = make_layout("zigzag", 4, 16, ulysses=2)
    assert [lay.positions(r).tolist() for r in range(4)] == [
        [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]
    ]
    assert (lay.ulysses, lay.ring.world_size, lay.ring.ulysses) == (2, 2, 1)
    assert lay.ring is make_layout("zigzag", 2, 16)  # the ring's own (memoised) layout
    assert repr(lay) == "Layout('zigzag', world_size=4, seq_len=16, ulysses=2)"


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped", "balanced"])
@pytest.mark.parametrize("ring, ulysses", GRIDS)
def test_grid_positions_follow_the_rank_convention(kind, ring, ulysses):
    world = ring * ulysses
    seq = seq_len_divisor(kind, world, ulysses=ulysses) * 3
    documents = [seq // 3, 1, seq - seq // 3 - 1] if kind == "balanced" else None
    lay = make_layout(kind, world, seq, ulysses=ulysses, documents=documents)
    ring_lay = make_layout(kind, ring, seq, documents=documents)
    assert lay.divisor == seq_len_divisor(kind, world, ulysses=ulysses)
    sub = seq // world
    for r in range(ring):
        chunk = ring_lay.positions(r)
        for u in range(ulysses):
            assert torch.equal(lay.positions(r * ulysses + u), chunk[u * sub:(u + 1) * sub])
    x = torch.randn(2, seq, 3, 4)
    shards = [lay.shard(x, g) for g in range(world)]
    torch.testing.assert_close(lay.unshard(shards), x, rtol=0, atol=0)


def test_seq_len_divisor_accounts_for_ulysses():
    assert seq_len_divisor("zigzag", 4) == 8  # the existing signature is unchanged
    assert seq_len_divisor("striped", 4) == 4
    assert seq_len_divisor("zigzag", 4, ulysses=2) == 4  # ring of 2: 2R = 4 = R * U
    assert seq_len_divisor("zigzag", 6, ulysses=2) == 6
    assert seq_len_divisor("zigzag", 4, ulysses=4) == 4  # ring of 1: sub-shards of one chunk
    assert seq_len_divisor("zigzag", 8, ulysses=4) == 8
    assert seq_len_divisor("contiguous", 8, ulysses=2) == 8
    assert seq_len_divisor("zigzag", 3, ulysses=1) == 6
    with pytest.raises(ValueError, match=r"ulysses: 3 ranks per Ulysses group do not divide "
                                         r"the 4 ranks; use a divisor of 4"):
        seq_len_divisor("zigzag", 4, ulysses=3)


def test_bad_grid_layouts_name_the_arithmetic():
    with pytest.raises(ValueError, match=r"layout: seq_len=18 cannot be split by layout "
                                         r"'zigzag' over 2 ring ranks x ulysses=2; it must be "
                                         r"a positive multiple of 4"):
        make_layout("zigzag", 4, 18, ulysses=2)
    with pytest.raises(ValueError, match=r"layout: got a layout for world_size=4, seq_len=16, "
                                         r"ulysses=1 but the call needs world_size=4, "
                                         r"seq_len=16, ulysses=2"):
        make_layout(make_layout("zigzag", 4, 16), 4, 16, ulysses=2)
    with pytest.raises(ValueError, match=r"ulysses=2 but the call needs world_size=4, "
                                         r"seq_len=16, ulysses=1"):
        make_layout(make_layout("zigzag", 4, 16, ulysses=2), 4, 16)


def test_a_ring_layout_or_position_lists_lift_to_the_grid():
    ring = [[0, 5, 2, 7], [4, 1, 6, 3]]  # a custom ring of 2
    lay = make_layout(ring, 4, 8, ulysses=2)
    assert [lay.positions(g).tolist() for g in range(4)] == [[0, 5], [2, 7], [4, 1], [6, 3]]
    assert lay.kind == "custom" and lay.ulysses == 2
    same = make_layout(make_layout("striped", 2, 8), 4, 8, ulysses=2)
    assert same is make_layout("striped", 4, 8, ulysses=2)
    assert make_layout(same, 4, 8, ulysses=2) is same


def _all_to_all(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """What every rank receives: block i of rank j's result is block j of rank i's buffer."""
    n = len(buffers)
    return [torch.stack([buffers[i][j] for i in range(n)]) for j in range(n)]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("ulysses", [2, 4])
def test_packing_swaps_sequence_for_heads_and_back(ulysses, batch):
    """Through a simulated all-to-all, rank u gets head group u of the whole chunk (q, k and
    v packed in one buffer), and the reverse packing restores every rank's inputs. The
    unpacked tensors own their memory (with one row a view would keep the whole received
    buffer alive for as long as autograd keeps q)."""
    chunk, dim = 4 * ulysses, 3
    heads = {"q": 2 * ulysses, "k": ulysses, "v": ulysses}
    full = {n: torch.randn(batch, chunk, h, dim) for n, h in heads.items()}
    sub = chunk // ulysses
    local = [[full[n][:, u * sub:(u + 1) * sub] for n in heads] for u in range(ulysses)]
    widths = [h // ulysses for h in heads.values()]
    received = _all_to_all([pack_for_heads(t, ulysses) for t in local])
    gathered = [unpack_heads(r, widths) for r in received]
    for u in range(ulysses):
        for (name, h), got in zip(heads.items(), gathered[u], strict=True):
            group = h // ulysses
            want = full[name][:, :, u * group:(u + 1) * group]
            assert got.is_contiguous()
            assert got.untyped_storage().data_ptr() != received[u].untyped_storage().data_ptr()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    back = _all_to_all([pack_for_sequence(g, ulysses) for g in gathered])
    for u in range(ulysses):
        restored = unpack_sequence(back[u], widths)
        for mine, want in zip(restored, local[u], strict=True):
            torch.testing.assert_close(mine, want, rtol=0, atol=0)
