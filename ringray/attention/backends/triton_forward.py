"""Triton forward kernel for one ring step: split full/straddling key loops, fused merge.

    out, lse = block_forward(q, k, v, q_pos, k_pos, causal=True, scale=0.125)
    block_forward(q, k, v, q_pos, k_pos, causal=True, scale=s, out=acc_out, lse=acc_lse,
                  key=BlockPairKey(layout, rank, source, documents))

``q`` is ``(batch, q_heads, sq, d)``, ``k``/``v`` ``(batch, kv_heads, sk, d)`` in float16,
bfloat16 or float32 (any strides, so the ring's transposed views need no copy); GQA/MQA by
indexing the kv head, never by repeating it. ``q_pos`` and ``k_pos`` are the tokens' global
positions; with packed documents, ``q_doc``/``k_doc`` are their document indices.

One program per (query tile, batch × head). It reads its query tile's row of the block
pair's tile lists (:mod:`.triton_tiles`, built once per block pair and tile shape and
cached when ``key`` names the tokens): first a main loop over the *full* key tiles (every
query sees every key), with no mask and no branch, so Triton can software-pipeline its K/V
loads (``num_stages``); then a loop over the *straddling* ones, which load the keys'
positions and document indices and mask per token. Empty tiles (every key after every
query, or in another document) are in neither list and never visited. Without a mask
(``causal=False``, no documents) there are no lists: the loop bounds are arithmetic, and
only the key tile that runs past the end of the block is masked.

With ``out``/``lse`` given (float32, ``(batch, q_heads, sq, d)`` / ``(batch, q_heads, sq)``,
initialised to 0 / -inf), the block's result is merged into them in place with the
log-sum-exp rule, so the ring step's merge costs no extra pass over the output. Rows that
see no key keep ``lse = -inf`` and output 0. Head dims that are not a power of two (80, 96)
are padded inside the kernel (masked loads), never in memory.

Element offsets are int64 wherever a row index meets a stride: the ring's ``(batch, seq,
heads, d)`` views have row stride ``heads × d``, so a block of 524,288 rows of 32 heads ×
128 passes 2**31 elements. Each program widens its row and tile-0 offsets once; the loop
adds an int64 tile start (one scalar product per tile).

Launch shapes come from :mod:`.triton_config`. The registered backend that calls this is
:class:`~ringray.attention.backends.triton.TritonBackend`. On CPU the kernel runs in Triton's
interpreter (``TRITON_INTERPRET=1``); its speed is only meaningful on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringray.attention.backends.common import BlockPairKey
from ringray.attention.backends.triton_common import (
    LN2,
    LOG2E,
    KernelLaunch,
    dot_mode,
    load_tokens,
    mma,
    padded_head_dim,
    visible,
)
from ringray.attention.backends.triton_config import TileConfig, kernel_configs
from ringray.attention.backends.triton_tiles import step_tokens


@triton.jit
def _attend_key_tile(
    acc, l_i, m_i, q, q_pos, q_doc, K_TILE0, V_TILE0, KPOS, KDOC, tile_n, sk, sks, svs, dim_ok,
    scale_log2, window, MASKED: tl.constexpr, MASKING: tl.constexpr, CAUSAL: tl.constexpr,
    DOCS: tl.constexpr, WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One online-softmax step of a query tile over key tile ``tile_n``: ``(acc, l, m)``.
    ``K_TILE0``/``V_TILE0`` point at key tile 0 (K as ``(d, BLOCK_N)``, V as ``(BLOCK_N, d)``).
    Unless ``MASKED`` the tile is full: inside the block (no column mask) and visible to
    every query, so no score is masked and no row can be all -inf."""
    start = (tile_n * BLOCK_N).to(tl.int64)  # row offsets can pass 2**31 elements
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < sk
    if MASKED:
        k = tl.load(K_TILE0 + start * sks, mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
    else:
        k = tl.load(K_TILE0 + start * sks, mask=dim_ok[:, None], other=0.0)
    scores = mma(q, k, None, UPCAST, PRECISION) * scale_log2  # base-2 exponent units
    if MASKED:
        # Padded query rows need no mask (q is 0 there and their results are not stored);
        # padded key columns would get weight, and so would keys the query may not see.
        allowed = col_ok[None, :]
        if MASKING:
            k_pos, k_doc = load_tokens(KPOS, KDOC, cols, col_ok, 0, CAUSAL, DOCS)
            allowed = allowed & visible(q_pos[:, None], k_pos[None, :], q_doc[:, None],
                                        k_doc[None, :], window, CAUSAL, DOCS, WINDOW)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = m_new  # finite: every score of a full tile is
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(V_TILE0 + start * svs, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
    else:
        v = tl.load(V_TILE0 + start * svs, mask=dim_ok[None, :], other=0.0)
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
    return acc, l_i, m_new


@triton.jit
def _forward_kernel(
    Q, K, V, QPOS, KPOS, QDOC, KDOC, COUNTS, INDICES, OUT, LSE, VISITS,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sob, soh, sos, sod, slb, slh, sls,
    q_heads, group, sq, sk, list_width, scale_log2, window,
    CAUSAL: tl.constexpr, DOCS: tl.constexpr, WINDOW: tl.constexpr, MASKING: tl.constexpr,
    MERGE: tl.constexpr, COUNT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    tile_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # batch/head offsets can pass 2**31 elements
    b = bh // q_heads
    h = bh % q_heads
    kv_h = h // group
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Element offsets in int64: row × row stride passes 2**31 in a long block (the ring's
    # (batch, seq, heads, d) views have row stride heads × d). Widened once per program;
    # the key loop adds an int64 tile start to the tile-0 pointers.
    row_start = (tile_m * BLOCK_M).to(tl.int64)
    tile_rows = tl.arange(0, BLOCK_M).to(tl.int64)
    keys = tl.arange(0, BLOCK_N).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < sq
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        Q + b * sqb + h * sqh + row_start * sqs + tile_rows[:, None] * sqs + dims[None, :] * sqd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    # Padded rows get position -1 and document -1: they see no key of a straddling tile.
    q_pos, q_doc = load_tokens(QPOS, QDOC, rows, row_ok, -1, CAUSAL, DOCS)
    k_tile0 = K + b * skb + kv_h * skh + keys[None, :] * sks + dims[:, None] * skd
    v_tile0 = V + b * svb + kv_h * svh + keys[:, None] * svs + dims[None, :] * svd
    if MASKING:  # this query tile's row of the tile lists
        num_full = tl.load(COUNTS + 2 * tile_m)
        num_masked = tl.load(COUNTS + 2 * tile_m + 1)
        row = INDICES + tile_m.to(tl.int64) * list_width
    else:  # every key tile is full but a short last one, which is masked
        num_full = sk // BLOCK_N
        num_masked = tl.cdiv(sk, BLOCK_N) - num_full
        row = INDICES
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    visited_full = tl.sum(tl.zeros([1], tl.int32), 0)
    visited_masked = tl.sum(tl.zeros([1], tl.int32), 0)
    # Main loop: full key tiles, read through the list (or in order); no branch, no mask.
    for slot in range(0, num_full):
        tile_n = slot
        if MASKING:
            tile_n = tl.load(row + slot)
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, q, q_pos, q_doc, k_tile0, v_tile0, KPOS, KDOC, tile_n, sk, sks, svs,
            dim_ok, scale_log2, window, False, MASKING, CAUSAL, DOCS, WINDOW, UPCAST, PRECISION,
            BLOCK_N)
        if COUNT:
            visited_full += 1
    # Then the straddling ones (and the block's short last tile), masked per token.
    for slot in range(num_full, num_full + num_masked):
        tile_n = slot
        if MASKING:
            tile_n = tl.load(row + slot)
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, q, q_pos, q_doc, k_tile0, v_tile0, KPOS, KDOC, tile_n, sk, sks, svs,
            dim_ok, scale_log2, window, True, MASKING, CAUSAL, DOCS, WINDOW, UPCAST, PRECISION,
            BLOCK_N)
        if COUNT:
            visited_masked += 1
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    block_out = acc / l_safe[:, None]
    block_lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    out_ptrs = (OUT + b * sob + h * soh + row_start * sos + tile_rows[:, None] * sos
                + dims[None, :] * sod)
    lse_ptrs = LSE + b * slb + h * slh + row_start * sls + tile_rows * sls
    io_mask = row_ok[:, None] & dim_ok[None, :]
    if MERGE:
        old_lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        old_out = tl.load(out_ptrs, mask=io_mask, other=0.0)
        new_lse = tl.maximum(old_lse, block_lse)
        top = tl.where(new_lse == float("-inf"), 0.0, new_lse)
        w_old = tl.exp(old_lse - top)
        w_new = tl.exp(block_lse - top)
        total = w_old + w_new
        denom = tl.where(total > 0, total, 1.0)
        merged_lse = tl.where(total > 0, top + tl.log(denom), float("-inf"))
        merged = (old_out * w_old[:, None] + block_out * w_new[:, None]) / denom[:, None]
        tl.store(out_ptrs, merged, mask=io_mask)
        tl.store(lse_ptrs, merged_lse, mask=row_ok)
    else:
        tl.store(out_ptrs, block_out, mask=io_mask)
        tl.store(lse_ptrs, block_lse, mask=row_ok)
    if COUNT:
        tl.atomic_add(VISITS, visited_full)
        tl.atomic_add(VISITS + 1, visited_masked)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_pos: torch.Tensor, k_pos: torch.Tensor, *,
    causal: bool, scale: float,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    key: BlockPairKey | None = None,
    config: TileConfig | None = None, visits: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one K/V block; merged into ``out``/``lse`` when given.

    ``q_doc``/``k_doc`` (both or neither) are the tokens' document indices: a query sees
    only keys of its own document. ``window`` (with ``causal``): a query sees only keys at
    most ``window - 1`` positions before it. ``key`` names the tokens (:class:`~.triton_tiles.
    BlockPairKey`) so that the tile lists are built once and then reused. ``config``
    overrides the launch shape from :func:`~.triton_config.kernel_configs`.
    ``visits`` (int32, two elements) counts the (query tile, key tile) pairs the kernel
    computed, ``[full, straddling]``, for tests of the tile skipping.
    """
    batch, q_heads, sq, head_dim = q.shape
    merge = out is not None
    if merge != (lse is not None):
        raise ValueError("out, lse: give both accumulators to merge into, or neither")
    if not merge:
        out = torch.empty(batch, q_heads, sq, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, q_heads, sq, dtype=torch.float32, device=q.device)
    launch = forward_launch(q, k, v, q_pos, k_pos, out, lse, causal=causal, scale=scale,
                            q_doc=q_doc, k_doc=k_doc, merge=merge, key=key, config=config,
                            visits=visits, window=window)
    _forward_kernel[launch.grid](*launch.args, **launch.kwargs)
    return out, lse


def forward_launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
    k_pos: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float,
    q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, merge: bool,
    key: BlockPairKey | None, config: TileConfig | None, visits: torch.Tensor | None,
    window: int | None = None,
) -> KernelLaunch:
    """The forward kernel's launch for :func:`block_forward`'s arguments (``out``/``lse``
    allocated; ``merge``: whether they hold earlier results), tile lists included."""
    batch, q_heads, sq, head_dim = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    cfg = config or kernel_configs(head_dim, q.dtype, q.device).forward
    t = step_tokens(q_pos, k_pos, q_doc, k_doc, q.device, causal=causal, block_m=cfg.block_m,
                    block_n=cfg.block_n, by_key=False, key=key, window=window)
    counter = visits if visits is not None else t.q_pos  # never written unless counting
    upcast, precision = dot_mode(q.dtype, q.device)
    return KernelLaunch(
        grid=(triton.cdiv(sq, cfg.block_m), batch * q_heads),
        args=(q, k, v, t.q_pos, t.k_pos, t.q_doc, t.k_doc, t.counts, t.indices, out, lse,
              counter, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
              q_heads, q_heads // kv_heads, sq, sk, t.width, scale * LOG2E, window or 0),
        kwargs={"CAUSAL": causal, "DOCS": t.docs, "WINDOW": window is not None,
                "MASKING": t.masking, "MERGE": merge,
                "COUNT": visits is not None, "UPCAST": upcast, "PRECISION": precision,
                "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                "BLOCK_D": padded_head_dim(head_dim), "HEAD_DIM": head_dim,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
