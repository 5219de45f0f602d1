"""The Triton kernels' tile lists (``triton_tiles``): what they promise and their cache.

The lists against the per-token mask built from the definition (``q_pos >= k_pos`` when
causal, same document), for the position patterns of every layout with and without packed
documents, blocks that are not a tile multiple and non-square tiles: every tile pair holding
a visible (query, key) pair is listed; a pair listed as full has every query seeing every
key inside the block; rows are ascending within each class; the transposed lists hold the
same pairs. These are pure torch and run fast.

The cache, through the backend's fused methods as a ring step calls them (kernels in
Triton's interpreter): a second call with the same block pair, tile shape and device builds
nothing, while another rank pair, other documents or another mask build their own lists.
"""

from __future__ import annotations

import pytest
import torch

from ringray.attention import make_layout
from ringray.attention.documents import check_documents

triton_tiles = pytest.importorskip("ringray.attention.backends.triton_tiles")

SEQ = 2 * 40  # 40 tokens per rank: not a multiple of the tiles below
DOCUMENTS = [1, 13, 9, 30, 2, 25]


def _tokens(kind: str, q_rank: int, k_rank: int, with_docs: bool):
    if kind == "permutation":
        perm = torch.randperm(SEQ, generator=torch.Generator().manual_seed(3))
        q_pos, k_pos = (perm[:40], perm[40:])[q_rank], (perm[:40], perm[40:])[k_rank]
    else:
        layout = make_layout(kind, 2, SEQ, documents=DOCUMENTS)
        q_pos, k_pos = layout.positions(q_rank), layout.positions(k_rank)
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    if not with_docs:
        return q_pos, k_pos, None, None
    ids = check_documents(DOCUMENTS, SEQ).ids.to(torch.int32)
    return q_pos, k_pos, ids[q_pos.long()], ids[k_pos.long()]


def _pairs(lists, cls: int) -> set[tuple[int, int]]:
    """(row tile, listed tile) pairs of class 0 (full) or 1 (straddling)."""
    out = set()
    for row, (num_full, num_masked) in enumerate(lists.counts.tolist()):
        slots = range(num_full) if cls == 0 else range(num_full, num_full + num_masked)
        out |= {(row, int(lists.indices[row, s])) for s in slots}
    return out


# Without a mask (full attention, no documents) the kernels build no lists.
@pytest.mark.parametrize(("causal", "with_docs"), [(True, False), (True, True), (False, True)],
                         ids=["causal", "causal-documents", "full-documents"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "striped", "balanced",
                                  "permutation"])
def test_lists_cover_every_visible_pair_and_full_means_unmasked(kind, causal,
                                                                with_docs) -> None:
    block_m, block_n = 16, 32  # non-square, and 40 tokens leave a short last tile on both
    for q_rank, k_rank in ((0, 0), (0, 1), (1, 0)):
        q_pos, k_pos, q_doc, k_doc = _tokens(kind, q_rank, k_rank, with_docs)
        seen = torch.ones(40, 40, dtype=torch.bool)
        if causal:
            seen &= q_pos[:, None] >= k_pos[None, :]
        if with_docs:
            seen &= q_doc[:, None] == k_doc[None, :]
        build = {"causal": causal, "block_m": block_m, "block_n": block_n}
        rows = triton_tiles.build_tile_lists(q_pos, k_pos, q_doc, k_doc, by_key=False, **build)
        cols = triton_tiles.build_tile_lists(q_pos, k_pos, q_doc, k_doc, by_key=True, **build)
        full, masked = _pairs(rows, 0), _pairs(rows, 1)
        assert not full & masked
        for m in range(3):
            for n in range(2):
                tile = seen[m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
                if tile.any():
                    assert (m, n) in full | masked, (q_rank, k_rank, m, n)
                if (m, n) in full:  # every query sees every key, and the tile is whole
                    assert tile.all() and (n + 1) * block_n <= 40, (q_rank, k_rank, m, n)
        for lists in (rows, cols):
            for row, (num_full, num_masked) in enumerate(lists.counts.tolist()):
                listed = lists.indices[row].tolist()
                assert listed[:num_full] == sorted(listed[:num_full])
                assert listed[num_full:num_full + num_masked] == sorted(
                    listed[num_full:num_full + num_masked])
        assert _pairs(cols, 0) == {(n, m) for m, n in full}
        assert _pairs(cols, 1) == {(n, m) for m, n in masked}


def test_cache_keeps_the_least_recently_used() -> None:
    """Bounded in entries and in bytes: the least recently used entries go first."""
    cache = triton_tiles.TileListCache(max_entries=2, max_bytes=10**6)
    lists = {name: triton_tiles.TileLists(torch.zeros(1, 2, dtype=torch.int32),
                                          torch.zeros(1, 1, dtype=torch.int32))
             for name in "abc"}
    for name in "ab":
        cache.get(name, lambda n=name: lists[n])
    assert cache.get("a", lambda: pytest.fail("a was cached")) is lists["a"]
    cache.get("c", lambda: lists["c"])  # drops b, the least recently used
    assert len(cache) == 2 and (cache.builds, cache.hits) == (3, 1)
    assert cache.nbytes == 2 * 12
    assert cache.get("b", lambda: lists["b"]) is lists["b"] and cache.builds == 4

    cache = triton_tiles.TileListCache(max_entries=10, max_bytes=2 * 12)
    for name in "abc":
        cache.get(name, lambda n=name: lists[n])
    assert len(cache) == 2 and cache.nbytes == 2 * 12  # a went for c's bytes


def test_second_ring_step_call_builds_no_tile_lists() -> None:
    """forward_into and backward_into with a BlockPairKey: the first call of each builds
    its lists (forward: per query tile; backward: per key tile), the same calls again build
    none; another rank pair, other documents and the full mask build their own."""
    from ringray.attention.backends.common import BlockPairKey, softmax_delta
    from ringray.attention.backends.triton import TritonBackend

    cache = triton_tiles.TILE_LISTS
    cache.clear()
    builds, hits = cache.builds, cache.hits
    layout = make_layout("zigzag", 2, SEQ)
    documents = check_documents(DOCUMENTS, SEQ)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 1, 40, 16, generator=g) for _ in range(2))
    kernel = TritonBackend()

    def step(q_rank: int, k_rank: int, docs, causal: bool = True) -> None:
        q_pos, k_pos = layout.positions(q_rank), layout.positions(k_rank)
        tokens = {"q_pos": q_pos, "k_pos": k_pos, "causal": causal, "scale": 0.25,
                  "key": BlockPairKey(layout, q_rank, k_rank, docs)}
        if docs is not None:
            tokens.update(q_doc=docs.ids[q_pos], k_doc=docs.ids[k_pos])
        out = torch.zeros(1, 2, 40, 16)
        lse = torch.full((1, 2, 40), float("-inf"))
        kernel.forward_into(q, k, v, out, lse, **tokens)
        grads = (torch.zeros_like(out), torch.zeros(1, 1, 40, 16), torch.zeros(1, 1, 40, 16))
        kernel.backward_into(dout, q, k, v, lse, softmax_delta(dout, out), *grads, **tokens)

    step(1, 0, None)
    assert cache.builds - builds == 2  # forward and backward lists
    step(1, 0, None)
    assert (cache.builds - builds, cache.hits - hits) == (2, 2)
    step(0, 1, None)
    step(1, 0, documents)
    step(1, 0, documents, causal=False)
    assert cache.builds - builds == 8
    step(1, 0, check_documents(list(DOCUMENTS), SEQ))  # equal documents: the same lists
    assert cache.builds - builds == 8


def test_ring_attention_reuses_its_tile_lists_and_device_tokens() -> None:
    """``ring_attention`` names every block pair it hands the Triton backend, so a second
    call (the next layer, or activation checkpointing's recomputation) with the same layout
    and documents builds no tile lists and moves no positions again, and gives the same
    output and gradients."""
    from ringray.attention import ring_attention
    from ringray.attention.ring import _device_tokens

    cache = triton_tiles.TILE_LISTS
    cache.clear()
    _device_tokens.cache_clear()
    layout = make_layout("balanced", 1, SEQ, documents=DOCUMENTS)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, SEQ, 2, 16, generator=g)
    k, v = (torch.randn(1, SEQ, 1, 16, generator=g) for _ in range(2))

    def call():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, layout=layout, backend="triton", documents=DOCUMENTS)
        out.square().sum().backward()
        return out.detach(), [t.grad for t in leaves]

    before = cache.builds
    first = call()
    builds = cache.builds
    assert builds - before == 2 and _device_tokens.cache_info().misses == 1
    second = call()
    assert cache.builds == builds and cache.hits >= 2
    assert _device_tokens.cache_info().hits >= 1 and _device_tokens.cache_info().misses == 1
    torch.testing.assert_close(second[0], first[0], rtol=0, atol=0)
    for a, b in zip(second[1], first[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
