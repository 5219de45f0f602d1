"""Triton forward kernel for one ring step: position-aware tile skipping and a fused merge.

    out, lse = block_forward(q, k, v, q_pos, k_pos, causal=True, scale=0.125)
    block_forward(q, k, v, q_pos, k_pos, causal=True, scale=s, out=acc_out, lse=acc_lse)

``q`` is ``(batch, q_heads, sq, d)``, ``k``/``v`` ``(batch, kv_heads, sk, d)`` in float16,
bfloat16 or float32 (any strides, so the ring's transposed views need no copy); GQA/MQA by
indexing the kv head, never by repeating it. ``q_pos`` and ``k_pos`` are the tokens' global
positions; with packed documents, ``q_doc``/``k_doc`` are their document indices. Each
(query tile, key tile) pair is classified from per-tile position and document ranges
computed once per call on the device (:func:`~.triton_common.classify_tile_pair`): *empty*
(every key after every query, or in another document: skipped, never loaded), *full*
(every query sees every key: no mask) or *straddling* (the only tiles that load positions
and document indices and apply the mask). A key tile that runs past the end of the block is
masked too; nothing else is.

With ``out``/``lse`` given (float32, ``(batch, q_heads, sq, d)`` / ``(batch, q_heads, sq)``,
initialised to 0 / -inf), the block's result is merged into them in place with the
log-sum-exp rule, so the ring step's merge costs no extra pass over the output. Rows that
see no key keep ``lse = -inf`` and output 0. Head dims that are not a power of two (80, 96)
are padded inside the kernel (masked loads), never in memory.

Launch shapes come from :mod:`.triton_config`. The registered backend that calls this is
:class:`~ringray.attention.backends.triton.TritonBackend`. On CPU the kernel runs in Triton's
interpreter (``TRITON_INTERPRET=1``); its speed is only meaningful on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringray.attention.backends.triton_common import (
    LN2,
    LOG2E,
    classify_tile_pair,
    dot_mode,
    load_tokens,
    mma,
    padded_head_dim,
    tile_args,
    token_tiles,
    visible,
)
from ringray.attention.backends.triton_config import TileConfig, kernel_configs


@triton.jit
def _forward_kernel(
    Q, K, V, QPOS, KPOS, QMIN, QMAX, KMIN, KMAX,
    QDOC, KDOC, QDMIN, QDMAX, KDMIN, KDMAX, OUT, LSE, VISITS,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sob, soh, sos, sod, slb, slh, sls,
    q_heads, group, sq, sk, num_k_tiles, scale_log2,
    CAUSAL: tl.constexpr, DOCS: tl.constexpr, MASKING: tl.constexpr,
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
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < sq
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :] * sqd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if MASKING:
        q_pos, q_doc = load_tokens(QPOS, QDOC, rows, row_ok, -1, CAUSAL, DOCS)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    visited = tl.sum(tl.zeros([1], tl.int32), 0)
    for tile_n in range(0, num_k_tiles):
        run = True
        straddles = False
        if MASKING:
            run, straddles = classify_tile_pair(QMIN, QMAX, KMIN, KMAX, QDMIN, QDMAX, KDMIN,
                                                KDMAX, tile_m, tile_n, CAUSAL, DOCS)
        if run:
            visited += 1
            cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < sk
            k = tl.load(
                K + b * skb + kv_h * skh + cols[None, :] * sks + dims[:, None] * skd,
                mask=col_ok[None, :] & dim_ok[:, None], other=0.0,
            )
            scores = mma(q, k, None, UPCAST, PRECISION) * scale_log2  # base-2 exponent units
            # Padded query rows need no mask (q is 0 there and their results are not stored);
            # padded key columns would get weight, so the block's last tile is masked.
            if straddles | ((tile_n + 1) * BLOCK_N > sk):
                allowed = col_ok[None, :]
                if MASKING:
                    k_pos, k_doc = load_tokens(KPOS, KDOC, cols, col_ok, 0, CAUSAL, DOCS)
                    allowed = allowed & visible(q_pos[:, None], k_pos[None, :], q_doc[:, None],
                                                k_doc[None, :], CAUSAL, DOCS)
                scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V + b * svb + kv_h * svh + cols[:, None] * svs + dims[None, :] * svd,
                mask=col_ok[:, None] & dim_ok[None, :], other=0.0,
            )
            acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
            m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    block_out = acc / l_safe[:, None]
    block_lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    out_ptrs = OUT + b * sob + h * soh + rows[:, None] * sos + dims[None, :] * sod
    lse_ptrs = LSE + b * slb + h * slh + rows * sls
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
        tl.atomic_add(VISITS, visited)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_pos: torch.Tensor, k_pos: torch.Tensor, *,
    causal: bool, scale: float,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    config: TileConfig | None = None, visits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one K/V block; merged into ``out``/``lse`` when given.

    ``q_doc``/``k_doc`` (both or neither) are the tokens' document indices: a query sees
    only keys of its own document. ``config`` overrides the launch shape from
    :func:`~.triton_config.kernel_configs`.
    ``visits`` (an int32 tensor of one element) counts the (query tile, key tile) pairs the
    kernel computed, for tests of the tile skipping.
    """
    batch, q_heads, sq, head_dim = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    merge = out is not None
    if merge != (lse is not None):
        raise ValueError("out, lse: give both accumulators to merge into, or neither")
    if not merge:
        out = torch.empty(batch, q_heads, sq, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, q_heads, sq, dtype=torch.float32, device=q.device)
    cfg = config or kernel_configs(head_dim, q.dtype, q.device).forward
    q_tiles = token_tiles(q_pos, q_doc, cfg.block_m, q.device)
    k_tiles = token_tiles(k_pos, k_doc, cfg.block_n, q.device)
    counter = visits if visits is not None else q_tiles.pos  # never written unless counting
    upcast, precision = dot_mode(q.dtype, q.device)
    docs = q_doc is not None
    grid = (q_tiles.num_tiles, batch * q_heads)
    _forward_kernel[grid](
        q, k, v, *tile_args(q_tiles, k_tiles), out, lse, counter,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        q_heads, q_heads // kv_heads, sq, sk, k_tiles.num_tiles, scale * LOG2E,
        CAUSAL=causal, DOCS=docs, MASKING=causal or docs, MERGE=merge,
        COUNT=visits is not None,
        UPCAST=upcast, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=padded_head_dim(head_dim),
        HEAD_DIM=head_dim, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
