"""The one rule that classifies (query tile, key tile) pairs, for the planner and the kernels.

    ranges_q = tile_ranges(q_pos, q_doc, block)        # per-tile min/max of positions, docs
    runs, straddles = classify_tile_pair(ranges_q, ranges_k, causal=True)

A pair that does not run is empty (never computed); one that runs and does not straddle is
computed without a mask; only straddling pairs need the per-token mask. The step planner
(:func:`~ringray.attention.pieces.plan_tiles`, CPU, for the sdpa and reference backends)
and the Triton tile lists (:mod:`~ringray.attention.backends.triton_tiles`, on the device)
call the same functions, so the two cannot disagree about which tiles are skipped. Pure
torch: no Triton import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileRanges:
    """Per-tile minimum and maximum (int32, one entry per tile; the last tile may be short)
    of one side's global positions and, with packed documents, document indices."""

    pos_min: torch.Tensor
    pos_max: torch.Tensor
    doc_min: torch.Tensor | None = None
    doc_max: torch.Tensor | None = None

    @property
    def num_tiles(self) -> int:
        return self.pos_min.numel()


def _min_max(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile minimum and maximum of int32 ``values``; the short last tile is padded with
    values that change neither (int32 max for the minimum, -1 below every position)."""
    n = values.numel()
    tiles = -(-n // block)
    padded_min = torch.full((tiles * block,), torch.iinfo(torch.int32).max, dtype=torch.int32,
                            device=values.device)
    padded_max = torch.full((tiles * block,), -1, dtype=torch.int32, device=values.device)
    padded_min[:n] = values
    padded_max[:n] = values
    return padded_min.view(tiles, block).amin(1), padded_max.view(tiles, block).amax(1)


def tile_ranges(positions: torch.Tensor, documents: torch.Tensor | None,
                block: int) -> TileRanges:
    """:class:`TileRanges` of int32 device ``positions`` (and ``documents``) cut into tiles
    of ``block`` tokens."""
    if documents is None:
        return TileRanges(*_min_max(positions, block))
    return TileRanges(*_min_max(positions, block), *_min_max(documents, block))


def classify_tile_pair(q: TileRanges, k: TileRanges, causal: bool,
                       window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(runs, straddles)``, bool ``(query tiles, key tiles)``: for every pair of a query
    tile and a key tile, from their position ranges under the causal rule ``q_pos >= k_pos``
    when ``causal`` and the sliding window ``q_pos - k_pos <= window - 1`` when ``window``
    is given, and from their document-index ranges when both sides have them (a query sees
    only keys of its own document).

    ``runs`` is false when every key comes after every query, or lies more than the window
    before every query, or in another document than every query: the pair is empty, and the
    kernels never visit it. ``straddles`` is true unless every query sees every key (one
    document on both sides, every key at or before every query when causal and within the
    window of every query): then the scores need the per-token mask (:func:`visible`); a
    pair that runs and does not straddle is computed unmasked.
    The step planner (:func:`ringray.attention.pieces.plan_tiles`) and the Triton tile lists
    (:mod:`ringray.attention.backends.triton_tiles`) both classify with it.
    """
    shape = (q.num_tiles, k.num_tiles)
    runs = torch.ones(shape, dtype=torch.bool, device=q.pos_min.device)
    straddles = torch.zeros(shape, dtype=torch.bool, device=q.pos_min.device)
    if causal:
        runs = k.pos_min[None, :] <= q.pos_max[:, None]
        straddles = k.pos_max[None, :] > q.pos_min[:, None]
    if window is not None:  # the nearest pair within the window; the farthest, for all
        runs = runs & (q.pos_min[:, None] - k.pos_max[None, :] <= window - 1)
        straddles = straddles | (q.pos_max[:, None] - k.pos_min[None, :] > window - 1)
    if q.doc_min is not None and k.doc_min is not None:
        qd_lo, qd_hi = q.doc_min[:, None], q.doc_max[:, None]
        kd_lo, kd_hi = k.doc_min[None, :], k.doc_max[None, :]
        runs = runs & (kd_lo <= qd_hi) & (kd_hi >= qd_lo)
        straddles = straddles | (qd_lo != qd_hi) | (kd_lo != kd_hi) | (qd_lo != kd_lo)
    return runs, straddles
