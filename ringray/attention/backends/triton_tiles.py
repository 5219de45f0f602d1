"""Which tiles a Triton program visits: full and straddling tile lists, built once, cached.

    lists = tile_lists(q_pos, k_pos, q_doc, k_doc, causal=True, block_m=128, block_n=64,
                       by_key=False, key=BlockPairKey(layout, rank, source, documents))
    lists.counts[m]   # (full, straddling) key tiles of query tile m, int32
    lists.indices[m]  # their key-tile indices: the full ones, then the straddling ones

A block-sparse description of one ring step's block pair, the block-mask idea of
FlexAttention (``kv_num_blocks``/``kv_indices`` with full and partial blocks apart) and
MagiAttention. Each program of the forward reads its query tile's row: an unmasked main
loop over the full key tiles, whose loads have no data-dependent branch around them (what
lets Triton software-pipeline them), then a masked loop over the straddling ones; empty
tiles are in neither count and never visited. ``by_key=True`` gives the transpose, per key
tile its full then straddling query tiles: the backward's loops.

The pairs are classified by :func:`ringray.attention.tiles.classify_tile_pair` (the one
rule, shared with the step planner), with one addition that belongs to the kernels, not the
rule: a key tile that runs past the end of the block holds padding keys, so its pairs are
straddling (masked), never full.

Rows are dense (one slot per tile of the other side; slots past the two counts are never
read) rather than packed end to end: a stable sort per row builds them on the device with
no host sync, where packing would need the total on the host first. That costs 4 bytes per
tile pair: 128 KiB for a 16k × 16k-token block pair in 128 × 64 tiles, 8 MiB at 128k.
Packing would cut that to the pairs that run (a small share with many short documents):
worth doing if the cache's byte bound starts to bite.

Building takes a few dozen small launches, so lists are cached per (block pair, mask, tile
shape, side, device) when the caller names its tokens with a :class:`BlockPairKey`; a hit
does no host→device copy and launches nothing. :data:`TILE_LISTS` is that cache; its
``builds`` count is for tests. Without a key the lists are built on every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from ringray.attention.backends.common import BlockPairKey
from ringray.attention.tiles import classify_tile_pair, tile_ranges


@dataclass(frozen=True)
class TileLists:
    """Per tile of one side (query tiles, or key tiles when built ``by_key``), the tiles of
    the other side it runs with: ``counts`` ``(tiles, 2)`` int32, the number of full and of
    straddling partners; ``indices`` ``(tiles, partners)`` int32, the full partners'
    indices (ascending), then the straddling ones' (ascending), then unused slots."""

    counts: torch.Tensor
    indices: torch.Tensor

    @property
    def width(self) -> int:
        """Slots per row: the row stride the kernels index ``indices`` with."""
        return self.indices.shape[1]

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes + self.indices.nbytes


class TileListCache:
    """A least-recently-used map from a hashable key to :class:`TileLists`, bounded in
    entries and in bytes of list tensors; ``builds`` and ``hits`` count what :meth:`get`
    did (for tests and for a look at the hit rate)."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, TileLists] = OrderedDict()
        self.nbytes = 0
        self.builds = 0
        self.hits = 0

    def get(self, key: Hashable, build: Callable[[], TileLists]) -> TileLists:
        """The entry for ``key``, built with ``build()`` on a miss (the least recently used
        entries are then dropped until the cache is within its bounds again)."""
        lists = self._entries.get(key)
        if lists is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return lists
        self.builds += 1
        lists = self._entries[key] = build()
        self.nbytes += lists.nbytes
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries
                                          or self.nbytes > self.max_bytes):
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes
        return lists

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)


# A ring of N ranks needs 2N entries per rank and document set (every source block, forward
# and backward tile shapes): 256 entries hold a 64-rank ring's twice. Most entries are
# small (128 KiB for a 16k-token block pair), but a 128k-token one takes 24 MiB (forward
# and backward), so bytes are bounded too.
TILE_LISTS = TileListCache(max_entries=256, max_bytes=512 * 2**20)


def build_tile_lists(
    q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None, *, causal: bool, block_m: int, block_n: int, by_key: bool,
    window: int | None = None,
) -> TileLists:
    """:class:`TileLists` of a block pair from its int32 device positions (and document
    indices), in ``block_m``-query × ``block_n``-key tiles: per query tile, or per key tile
    when ``by_key``; ``window``: a sliding window."""
    q_tiles = tile_ranges(q_pos, q_doc, block_m)
    k_tiles = tile_ranges(k_pos, k_doc, block_n)
    runs, straddles = classify_tile_pair(q_tiles, k_tiles, causal, window)
    if k_pos.numel() % block_n:  # the last key tile's padding keys must be masked
        straddles = straddles.clone()
        straddles[:, -1] = True
    full, masked = runs & ~straddles, runs & straddles
    if by_key:
        full, masked = full.t(), masked.t()
    # Class 0 (full), 1 (straddling), 2 (empty); a stable sort of each row's classes lists
    # the full partners first and the straddling ones next, each in ascending tile order.
    classes = 2 - 2 * full.to(torch.int8) - masked.to(torch.int8)
    indices = torch.sort(classes, dim=1, stable=True).indices.to(torch.int32).contiguous()
    counts = torch.stack((full.sum(1), masked.sum(1)), 1).to(torch.int32).contiguous()
    return TileLists(counts, indices)


def tile_lists(
    q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None, *, causal: bool, block_m: int, block_n: int, by_key: bool,
    key: BlockPairKey | None = None, cache: TileListCache = TILE_LISTS,
    window: int | None = None,
) -> TileLists:
    """:func:`build_tile_lists`, through ``cache`` when ``key`` names the tokens."""

    def build() -> TileLists:
        return build_tile_lists(q_pos, k_pos, q_doc, k_doc, causal=causal, block_m=block_m,
                                block_n=block_n, by_key=by_key, window=window)

    if key is None:
        return build()
    return cache.get((key, causal, window, block_m, block_n, by_key, q_pos.device), build)


@dataclass(frozen=True)
class StepTokens:
    """What a kernel launch reads about one block pair's tokens: int32 device positions and
    document ids (the positions stand in when there are no documents: never read then),
    and the tile lists with their width (the positions stand in, width 0, when nothing is
    masked: no lists are built or read). ``docs`` and ``masking`` are the kernels' flags."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_doc: torch.Tensor
    k_doc: torch.Tensor
    counts: torch.Tensor
    indices: torch.Tensor
    width: int
    docs: bool
    masking: bool


def step_tokens(
    q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None, device: torch.device, *, causal: bool, block_m: int,
    block_n: int, by_key: bool, key: BlockPairKey | None, window: int | None = None,
) -> StepTokens:
    """The forward's (``by_key=False``) or the backward's (``by_key=True``) view of a block
    pair's tokens, for tiles of ``block_m`` queries × ``block_n`` keys."""
    docs = q_doc is not None
    masking = causal or docs
    q_pos, k_pos = _int32(q_pos, device), _int32(k_pos, device)
    q_doc = _int32(q_doc, device) if docs else q_pos
    k_doc = _int32(k_doc, device) if docs else k_pos
    if not masking:
        return StepTokens(q_pos, k_pos, q_doc, k_doc, q_pos, q_pos, 0, docs, masking)
    lists = tile_lists(q_pos, k_pos, q_doc if docs else None, k_doc if docs else None,
                       causal=causal, block_m=block_m, block_n=block_n, by_key=by_key, key=key,
                       window=window)
    return StepTokens(q_pos, k_pos, q_doc, k_doc, lists.counts, lists.indices, lists.width,
                      docs, masking)


def _int32(positions: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Global positions (or document indices) as the contiguous int32 device tensor the
    kernels read; no copy when they already are (what the ring passes)."""
    return positions.to(device=device, dtype=torch.int32).contiguous()
