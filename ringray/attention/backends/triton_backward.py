"""Triton backward kernels for one ring step: dQ, dK, dV with position-aware tile skipping.

    delta = softmax_delta(dout, out)             # once per ring call, not per step
    block_backward(dout, q, k, v, lse, delta, q_pos, k_pos, causal=True, scale=s,
                   dq=dq_acc, dk=dk_acc, dv=dv_acc)   # adds this block's gradients in place

Shapes follow :mod:`.triton_forward`: ``q``/``dout`` ``(batch, q_heads, sq, d)``, ``k``/``v``
``(batch, kv_heads, sk, d)``, any strides. ``lse`` is the *final* natural-log LSE of the
query rows over the whole ring and ``delta = rowsum(dout * out)`` over the final output,
both float32 ``(batch, q_heads, sq)``: with them, the probabilities of this block are exact
(``exp(s - lse)``) and its gradients are exact partial sums (the flash-attention backward
identity), so a ring adds one block's gradients per step and never rescales.

Two kernels, one per output, so neither needs atomics:

- ``_dkdv_kernel``: one program per (key tile, batch, kv head). It keeps its K/V tile and
  float32 dK/dV accumulators resident and loops over the query heads that share the kv
  head (the GQA reduction happens in registers) and over their query tiles.
- ``_dq_kernel``: one program per (query tile, batch, query head), looping over key tiles.

Both classify tile pairs like the forward (:func:`~.triton_common.classify_tile_pair`, with
packed documents from the tiles' document ranges too): empty pairs are skipped without
loading anything, full pairs run unmasked, straddling pairs apply the per-token mask
(``q_pos >= k_pos``, same document; :func:`~.triton_common.visible`), and the tile that runs
past the end of the key block masks its padding. A row that saw no key
(``lse = -inf``) gets exactly zero gradients. Results are added to float32 accumulators
(allocated zeroed when not given). ``softmax_delta`` lives in :mod:`.common`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringray.attention.backends.triton_common import (
    KERNEL_LOG2E,
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
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, KPOS, QMIN, QMAX, KMIN, KMAX,
    QDOC, KDOC, QDMIN, QDMAX, KDMIN, KDMAX, VISITS,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sdob, sdoh, sdos, sdod, slb, slh, sls, sdlb, sdlh, sdls,
    sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd,
    kv_heads, group, sq, sk, num_q_tiles, scale, scale_log2,
    CAUSAL: tl.constexpr, DOCS: tl.constexpr, MASKING: tl.constexpr,
    COUNT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    tile_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # batch/head offsets can pass 2**31 elements
    b = bh // kv_heads
    kv_h = bh % kv_heads
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < sk
    dim_ok = dims < HEAD_DIM
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + b * skb + kv_h * skh + cols[:, None] * sks + dims[None, :] * skd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kv_h * svh + cols[:, None] * svs + dims[None, :] * svd,
                mask=kv_mask, other=0.0)
    if MASKING:
        k_pos, k_doc = load_tokens(KPOS, KDOC, cols, col_ok, 0, CAUSAL, DOCS)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    visited = tl.sum(tl.zeros([1], tl.int32), 0)
    # Padded query rows (past sq) load q = dO = lse = delta = 0: they add exactly 0 to dK/dV.
    # Padded keys (past sk) are never stored, but are masked all the same: unmasked, their
    # score 0 gives probability exp(-lse), infinite when lse is far below zero.
    edge = (tile_n + 1) * BLOCK_N > sk
    for h in range(kv_h * group, kv_h * group + group):
        for tile_m in range(0, num_q_tiles):
            run = True
            straddles = False
            if MASKING:
                run, straddles = classify_tile_pair(QMIN, QMAX, KMIN, KMAX, QDMIN, QDMAX,
                                                    KDMIN, KDMAX, tile_m, tile_n, CAUSAL, DOCS)
            if run:
                visited += 1
                rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = rows < sq
                q_t = tl.load(  # (BLOCK_D, BLOCK_M): q transposed by its pointers
                    Q + b * sqb + h * sqh + rows[None, :] * sqs + dims[:, None] * sqd,
                    mask=row_ok[None, :] & dim_ok[:, None], other=0.0,
                )
                do = tl.load(
                    DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :] * sdod,
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
                )
                lse = tl.load(LSE + b * slb + h * slh + rows * sls, mask=row_ok, other=0.0)
                # A row that saw no key has lse -inf and every score masked: use 0 so its
                # probabilities come out exp2(-inf - 0) = 0, never exp2(-inf + inf) = NaN.
                lse_log2 = tl.where(lse == float("-inf"), 0.0, lse * KERNEL_LOG2E)
                delta = tl.load(DELTA + b * sdlb + h * sdlh + rows * sdls, mask=row_ok,
                                other=0.0)
                s_t = mma(k, q_t, None, UPCAST, PRECISION) * scale_log2
                if straddles | edge:
                    allowed = col_ok[:, None]
                    if MASKING:
                        q_pos, q_doc = load_tokens(QPOS, QDOC, rows, row_ok, -1, CAUSAL, DOCS)
                        allowed = allowed & visible(q_pos[None, :], k_pos[:, None],
                                                    q_doc[None, :], k_doc[:, None], CAUSAL, DOCS)
                    s_t = tl.where(allowed, s_t, float("-inf"))
                p_t = tl.exp2(s_t - lse_log2[None, :])
                dv = mma(p_t.to(do.dtype), do, dv, UPCAST, PRECISION)
                dp_t = mma(v, tl.trans(do), None, UPCAST, PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                dk = mma(ds_t.to(q_t.dtype), tl.trans(q_t), dk, UPCAST, PRECISION)
    dk_ptrs = DK + b * sdkb + kv_h * sdkh + cols[:, None] * sdks + dims[None, :] * sdkd
    dv_ptrs = DV + b * sdvb + kv_h * sdvh + cols[:, None] * sdvs + dims[None, :] * sdvd
    tl.store(dk_ptrs, tl.load(dk_ptrs, mask=kv_mask, other=0.0) + dk * scale, mask=kv_mask)
    tl.store(dv_ptrs, tl.load(dv_ptrs, mask=kv_mask, other=0.0) + dv, mask=kv_mask)
    if COUNT:
        tl.atomic_add(VISITS, visited)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, QMIN, QMAX, KMIN, KMAX,
    QDOC, KDOC, QDMIN, QDMAX, KDMIN, KDMAX, VISITS,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sdob, sdoh, sdos, sdod, slb, slh, sls, sdlb, sdlh, sdls, sdqb, sdqh, sdqs, sdqd,
    q_heads, group, sq, sk, num_k_tiles, scale, scale_log2,
    CAUSAL: tl.constexpr, DOCS: tl.constexpr, MASKING: tl.constexpr,
    COUNT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
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
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :] * sqd,
                mask=io_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :] * sdod,
                 mask=io_mask, other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + rows * sls, mask=row_ok, other=0.0)
    lse_log2 = tl.where(lse == float("-inf"), 0.0, lse * KERNEL_LOG2E)  # see _dkdv
    delta = tl.load(DELTA + b * sdlb + h * sdlh + rows * sdls, mask=row_ok, other=0.0)
    if MASKING:
        q_pos, q_doc = load_tokens(QPOS, QDOC, rows, row_ok, -1, CAUSAL, DOCS)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
            kv_t_mask = col_ok[None, :] & dim_ok[:, None]
            k_t = tl.load(K + b * skb + kv_h * skh + cols[None, :] * sks + dims[:, None] * skd,
                          mask=kv_t_mask, other=0.0)
            v_t = tl.load(V + b * svb + kv_h * svh + cols[None, :] * svs + dims[:, None] * svd,
                          mask=kv_t_mask, other=0.0)
            scores = mma(q, k_t, None, UPCAST, PRECISION) * scale_log2
            # Padded keys (k = 0, score 0) would get probability exp(-lse), infinite when
            # lse is far below zero (then inf * 0 = NaN in dQ): mask the block's last tile.
            if straddles | ((tile_n + 1) * BLOCK_N > sk):
                allowed = col_ok[None, :]
                if MASKING:
                    k_pos, k_doc = load_tokens(KPOS, KDOC, cols, col_ok, 0, CAUSAL, DOCS)
                    allowed = allowed & visible(q_pos[:, None], k_pos[None, :], q_doc[:, None],
                                                k_doc[None, :], CAUSAL, DOCS)
                scores = tl.where(allowed, scores, float("-inf"))
            p = tl.exp2(scores - lse_log2[:, None])
            dp = mma(do, v_t, None, UPCAST, PRECISION)
            ds = p * (dp - delta[:, None])
            dq = mma(ds.to(k_t.dtype), tl.trans(k_t), dq, UPCAST, PRECISION)
    dq_ptrs = DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + dims[None, :] * sdqd
    tl.store(dq_ptrs, tl.load(dq_ptrs, mask=io_mask, other=0.0) + dq * scale, mask=io_mask)
    if COUNT:
        tl.atomic_add(VISITS, visited)


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
    causal: bool, scale: float,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    configs: tuple[TileConfig, TileConfig] | None = None, visits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add this K/V block's ``(dq, dk, dv)`` to float32 accumulators (zeros if not given).

    ``q_doc``/``k_doc`` (both or neither) are the tokens' document indices, as in
    :func:`~.triton_forward.block_forward`. ``configs`` is ``(dkdv, dq)`` launch shapes,
    overriding the table. ``visits`` (int32, two elements) counts the tile pairs each kernel
    computed: ``[dkdv, dq]``.
    """
    batch, q_heads, sq, head_dim = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    f32 = {"dtype": torch.float32, "device": q.device}
    dq = dq if dq is not None else torch.zeros(batch, q_heads, sq, head_dim, **f32)
    dk = dk if dk is not None else torch.zeros(batch, kv_heads, sk, head_dim, **f32)
    dv = dv if dv is not None else torch.zeros(batch, kv_heads, sk, head_dim, **f32)
    if configs is None:
        table = kernel_configs(head_dim, q.dtype, q.device)
        configs = (table.backward_dkdv, table.backward_dq)
    dkdv_cfg, dq_cfg = configs
    upcast, precision = dot_mode(q.dtype, q.device)
    docs = q_doc is not None
    common = {
        "CAUSAL": causal, "DOCS": docs, "MASKING": causal or docs, "COUNT": visits is not None,
        "UPCAST": upcast, "PRECISION": precision, "BLOCK_D": padded_head_dim(head_dim),
        "HEAD_DIM": head_dim,
    }
    inputs = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
              *delta.stride())
    group = q_heads // kv_heads

    q_tiles = token_tiles(q_pos, q_doc, dkdv_cfg.block_m, q.device)
    k_tiles = token_tiles(k_pos, k_doc, dkdv_cfg.block_n, q.device)
    counter = visits[0:1] if visits is not None else q_tiles.pos  # written only when counting
    _dkdv_kernel[(k_tiles.num_tiles, batch * kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, *tile_args(q_tiles, k_tiles),
        counter, *inputs, *dk.stride(), *dv.stride(),
        kv_heads, group, sq, sk, q_tiles.num_tiles, scale, scale * LOG2E,
        BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n,
        num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages, **common,
    )

    q_tiles = token_tiles(q_pos, q_doc, dq_cfg.block_m, q.device)
    k_tiles = token_tiles(k_pos, k_doc, dq_cfg.block_n, q.device)
    counter = visits[1:2] if visits is not None else q_tiles.pos
    _dq_kernel[(q_tiles.num_tiles, batch * q_heads)](
        q, k, v, dout, lse, delta, dq, *tile_args(q_tiles, k_tiles),
        counter, *inputs, *dq.stride(),
        q_heads, group, sq, sk, k_tiles.num_tiles, scale, scale * LOG2E,
        BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n,
        num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages, **common,
    )
    return dq, dk, dv
