"""Triton backward kernel for one ring step: dQ, dK, dV in one pass over the block pair.

    delta = softmax_delta_triton(dout, out)      # once per ring call, not per step
    block_backward(dout, q, k, v, lse, delta, q_pos, k_pos, causal=True, scale=s,
                   dq=dq_acc, dk=dk_acc, dv=dv_acc)   # adds this block's gradients in place

Shapes follow :mod:`.triton_forward`: ``q``/``dout`` ``(batch, q_heads, sq, d)``, ``k``/``v``
``(batch, kv_heads, sk, d)``, any strides. ``lse`` is the *final* natural-log LSE of the
query rows over the whole ring and ``delta = rowsum(dout * out)`` over the final output,
both float32 ``(batch, q_heads, sq)``: with them, the probabilities of this block are exact
(``exp(s - lse)``) and its gradients are exact partial sums (the flash-attention backward
identity), so a ring adds one block's gradients per step and never rescales.

``softmax_delta_triton`` computes ``delta`` in a small kernel of its own that reads ``dout``
and ``out`` in their dtypes and strides (the ring's transposed views): the same sums as
:func:`~.common.softmax_delta`, without its two float32 copies of both tensors.

One program per (key tile, batch × query head), the flash-attention 2 design: it keeps its
K/V tile (of the query head's kv head) and float32 dK/dV accumulators resident and loops
over the query tiles that run with its key tile, read from the block pair's *transposed*
tile lists (:mod:`.triton_tiles`, ``by_key``): an unmasked, branch-free loop over the full
ones, then a masked loop over the straddling ones; empty pairs are never visited. Each pair
computes ``S = QKᵀ`` and ``dP = dO·Vᵀ`` once and uses them for all three gradients: dK and
dV add up in registers, and the pair's dQ share ``dS·K`` is added to the float32 dQ
accumulator with atomic adds (several key tiles add to one query tile's rows).

GQA/MQA: the ``group`` query heads that share a kv head run in ``group`` programs (the grid
has ``group`` times more programs than one per kv head would, which keeps a GPU busy when
kv heads are few), and each adds its dK/dV tile once, at its end. With ``group == 1`` that
is a plain load-add-store (one owner per row); with ``group > 1`` it is a relaxed atomic
add, as for dQ. The alternative, per-query-head float32 dK/dV buffers summed after the
kernel (flash-attention 2's CUDA code), would cost ``group`` times the accumulators'
memory for every ring step and another pass over them; the atomics add the same number of
elements, once per program, and need nothing more.

The price of the atomics is that the float32 sums happen in whatever order the programs
reach them, so dQ, and dK/dV under GQA/MQA, can differ between runs in their last bits
(dK/dV with one query head per kv head cannot: each row has one owner program).
Flash-attention 2 makes the same choice for dQ (accumulated with atomic adds in float32,
deterministic only on request); Triton's fused-attention tutorial instead runs a second
pass per query tile that recomputes ``QKᵀ`` and ``dP``, deterministic at the cost of two of
the five matrix products again (this module's design before the single pass). A row that
saw no key (``lse = -inf``) gets exactly zero gradients.

Element offsets (row × row stride) are int64, as in the forward: a long block's rows ×
heads × d passes 2**31 (:mod:`.triton_overflow` checks it). The key tile's are widened
once per program, each query tile's as the loop reaches it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringray.attention.backends.common import BlockPairKey
from ringray.attention.backends.triton_common import (
    KERNEL_LOG2E,
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
def _query_tile_grads(
    dk, dv, k, v, k_pos, k_doc, col_ok, tile_m, Q_H, DO_H, LSE_H, DELTA_H, DQ_H, QPOS, QDOC,
    sqs, sqd, sdos, sdod, sls, sdls, sdqs, sdqd, sq, dims, dim_ok, scale, scale_log2, window,
    MASKED: tl.constexpr, MASKING: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One (query tile, key tile) pair: returns ``(dk, dv)`` with its shares added and adds
    its dQ share to ``DQ_H`` (the query head's float32 dQ) atomically. ``Q_H``... point at
    the query head's rows. Unless ``MASKED`` the pair is full: every query sees every key
    and the key tile lies inside the block, so no score is masked."""
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_offsets = rows.to(tl.int64)  # × a row stride can pass 2**31 elements
    row_ok = rows < sq  # the block's last query tile may be short: load 0 past its end
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q_H + row_offsets[:, None] * sqs + dims[None, :] * sqd, mask=io_mask,
                other=0.0)
    do = tl.load(DO_H + row_offsets[:, None] * sdos + dims[None, :] * sdod, mask=io_mask,
                 other=0.0)
    lse = tl.load(LSE_H + row_offsets * sls, mask=row_ok, other=0.0)
    # A row that saw no key has lse -inf and every score masked: use 0 so its probabilities
    # come out exp2(-inf - 0) = 0, never exp2(-inf + inf) = NaN. Padded rows (q = dO = lse =
    # delta = 0) add exactly 0 to dK/dV and their dQ is not stored.
    lse_log2 = tl.where(lse == float("-inf"), 0.0, lse * KERNEL_LOG2E)
    delta = tl.load(DELTA_H + row_offsets * sdls, mask=row_ok, other=0.0)
    s_t = mma(k, tl.trans(q), None, UPCAST, PRECISION) * scale_log2  # (keys, queries)
    if MASKED:
        # Padded keys (past sk) are never stored, but are masked all the same: unmasked,
        # their score 0 gives probability exp(-lse), infinite when lse is far below zero.
        allowed = col_ok[:, None]
        if MASKING:
            q_pos, q_doc = load_tokens(QPOS, QDOC, rows, row_ok, -1, CAUSAL, DOCS)
            allowed = allowed & visible(q_pos[None, :], k_pos[:, None], q_doc[None, :],
                                        k_doc[:, None], window, CAUSAL, DOCS, WINDOW)
        s_t = tl.where(allowed, s_t, float("-inf"))
    p_t = tl.exp2(s_t - lse_log2[None, :])
    dv = mma(p_t.to(do.dtype), do, dv, UPCAST, PRECISION)
    dp_t = mma(v, tl.trans(do), None, UPCAST, PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    ds_t = ds_t.to(q.dtype)
    dk = mma(ds_t, q, dk, UPCAST, PRECISION)
    dq = mma(tl.trans(ds_t), k, None, UPCAST, PRECISION)
    # Relaxed: a float add that no other memory access waits on (no fence needed).
    tl.atomic_add(DQ_H + row_offsets[:, None] * sdqs + dims[None, :] * sdqd, dq * scale,
                  mask=io_mask, sem="relaxed")
    return dk, dv


@triton.jit
def _backward_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DK, DV, QPOS, KPOS, QDOC, KDOC, COUNTS, INDICES, VISITS,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sdob, sdoh, sdos, sdod, slb, slh, sls, sdlb, sdlh, sdls,
    sdqb, sdqh, sdqs, sdqd, sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd,
    q_heads, group, sq, sk, list_width, scale, scale_log2, window,
    CAUSAL: tl.constexpr, DOCS: tl.constexpr, WINDOW: tl.constexpr, MASKING: tl.constexpr,
    SHARED_KV: tl.constexpr, COUNT: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    tile_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # batch/head offsets can pass 2**31 elements
    b = bh // q_heads
    h = bh % q_heads
    kv_h = h // group
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_offsets = cols.to(tl.int64)  # × a row stride can pass 2**31 elements
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < sk
    dim_ok = dims < HEAD_DIM
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + b * skb + kv_h * skh + col_offsets[:, None] * sks + dims[None, :] * skd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kv_h * svh + col_offsets[:, None] * svs + dims[None, :] * svd,
                mask=kv_mask, other=0.0)
    k_pos, k_doc = load_tokens(KPOS, KDOC, cols, col_ok, 0, CAUSAL, DOCS)
    if MASKING:  # this key tile's row of the transposed tile lists
        num_full = tl.load(COUNTS + 2 * tile_n)
        num_masked = tl.load(COUNTS + 2 * tile_n + 1)
        row = INDICES + tile_n.to(tl.int64) * list_width
    else:  # all query tiles are full, unless this key tile is short: then all are masked
        num_query_tiles = tl.cdiv(sq, BLOCK_M)
        short = ((tile_n + 1) * BLOCK_N > sk).to(tl.int32)
        num_full = num_query_tiles * (1 - short)
        num_masked = num_query_tiles * short
        row = INDICES
    q_h = Q + b * sqb + h * sqh
    do_h = DO + b * sdob + h * sdoh
    lse_h = LSE + b * slb + h * slh
    delta_h = DELTA + b * sdlb + h * sdlh
    dq_h = DQ + b * sdqb + h * sdqh
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    visited_full = tl.sum(tl.zeros([1], tl.int32), 0)
    visited_masked = tl.sum(tl.zeros([1], tl.int32), 0)
    # Main loop: full query tiles through the list (or in order); no branch and no score
    # mask (loads still stop at the block's end: its last query tile may be short).
    for slot in range(0, num_full):
        tile_m = slot
        if MASKING:
            tile_m = tl.load(row + slot)
        dk, dv = _query_tile_grads(
            dk, dv, k, v, k_pos, k_doc, col_ok, tile_m, q_h, do_h, lse_h, delta_h, dq_h, QPOS,
            QDOC, sqs, sqd, sdos, sdod, sls, sdls, sdqs, sdqd, sq, dims, dim_ok, scale,
            scale_log2, window, False, MASKING, CAUSAL, DOCS, WINDOW, UPCAST, PRECISION, BLOCK_M)
        if COUNT:
            visited_full += 1
    # Then the straddling ones, masked per token (and every pair of a short key tile).
    for slot in range(num_full, num_full + num_masked):
        tile_m = slot
        if MASKING:
            tile_m = tl.load(row + slot)
        dk, dv = _query_tile_grads(
            dk, dv, k, v, k_pos, k_doc, col_ok, tile_m, q_h, do_h, lse_h, delta_h, dq_h, QPOS,
            QDOC, sqs, sqd, sdos, sdod, sls, sdls, sdqs, sdqd, sq, dims, dim_ok, scale,
            scale_log2, window, True, MASKING, CAUSAL, DOCS, WINDOW, UPCAST, PRECISION, BLOCK_M)
        if COUNT:
            visited_masked += 1
    if num_full + num_masked > 0:  # a key tile that no query sees adds nothing
        dk_ptrs = (DK + b * sdkb + kv_h * sdkh + col_offsets[:, None] * sdks
                   + dims[None, :] * sdkd)
        dv_ptrs = (DV + b * sdvb + kv_h * sdvh + col_offsets[:, None] * sdvs
                   + dims[None, :] * sdvd)
        if SHARED_KV:  # the group's other query heads add to the same rows
            tl.atomic_add(dk_ptrs, dk * scale, mask=kv_mask, sem="relaxed")
            tl.atomic_add(dv_ptrs, dv, mask=kv_mask, sem="relaxed")
        else:  # this program is the rows' only writer
            tl.store(dk_ptrs, tl.load(dk_ptrs, mask=kv_mask, other=0.0) + dk * scale,
                     mask=kv_mask)
            tl.store(dv_ptrs, tl.load(dv_ptrs, mask=kv_mask, other=0.0) + dv, mask=kv_mask)
    if COUNT:
        tl.atomic_add(VISITS, visited_full)
        tl.atomic_add(VISITS + 1, visited_masked)


@triton.jit
def _delta_kernel(
    DO, OUT, DELTA, sdob, sdoh, sdos, sdod, sob, soh, sos, sod, sdlb, sdlh, sdls, heads, seq,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """``DELTA[b, h, rows] = rowsum(DO * OUT)`` in float32, for one tile of rows."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    h = bh % heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_offsets = rows.to(tl.int64)  # × row stride can pass 2**31 elements
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    do = tl.load(DO + b * sdob + h * sdoh + row_offsets[:, None] * sdos + dims[None, :] * sdod,
                 mask=mask, other=0.0)
    out = tl.load(OUT + b * sob + h * soh + row_offsets[:, None] * sos + dims[None, :] * sod,
                  mask=mask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * out.to(tl.float32), 1)
    tl.store(DELTA + b * sdlb + h * sdlh + row_offsets * sdls, delta, mask=row_ok)


# Elements of each input a delta program reads: the kernel only streams dO and O once, so
# the tile is sized for enough bytes in flight per program, not tuned per GPU.
DELTA_TILE_ELEMENTS = 8192


def softmax_delta_triton(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dout * out)`` as float32 ``(batch, heads, seq)``: the backward's per-row
    term, what :func:`~.common.softmax_delta` computes, in one kernel that reads ``dout``
    and ``out`` (``(batch, heads, seq, d)``, each in its own dtype and strides, so the
    ring's transposed views) without converting or copying them."""
    if dout.dim() != 4 or dout.shape != out.shape:
        raise ValueError(f"dout, out: want equal (batch, heads, seq, d) shapes, got "
                         f"{tuple(dout.shape)} and {tuple(out.shape)}")
    batch, heads, seq, head_dim = dout.shape
    delta = torch.empty(batch, heads, seq, dtype=torch.float32, device=dout.device)
    width = padded_head_dim(head_dim)
    block_m = max(16, DELTA_TILE_ELEMENTS // width)
    grid = (triton.cdiv(seq, block_m), batch * heads)
    _delta_kernel[grid](dout, out, delta, *dout.stride(), *out.stride(), *delta.stride(),
                        heads, seq, BLOCK_M=block_m, BLOCK_D=width, HEAD_DIM=head_dim)
    return delta


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
    causal: bool, scale: float,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None, key: BlockPairKey | None = None,
    config: TileConfig | None = None, visits: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add this K/V block's ``(dq, dk, dv)`` to float32 accumulators (zeros if not given).

    ``q_doc``/``k_doc`` (both or neither) are the tokens' document indices, ``window`` a
    sliding window, and ``key`` names the tokens for the tile-list cache, as in
    :func:`~.triton_forward.block_forward`.
    ``config`` overrides the table's launch shape (``block_m`` queries per inner step,
    ``block_n`` keys per program, one program per query head). ``visits`` (int32, two
    elements) counts the (query tile, key tile) pairs computed, once per query head,
    ``[full, straddling]``.
    """
    batch, q_heads, sq, head_dim = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    f32 = {"dtype": torch.float32, "device": q.device}
    dq = dq if dq is not None else torch.zeros(batch, q_heads, sq, head_dim, **f32)
    dk = dk if dk is not None else torch.zeros(batch, kv_heads, sk, head_dim, **f32)
    dv = dv if dv is not None else torch.zeros(batch, kv_heads, sk, head_dim, **f32)
    launch = backward_launch(dout, q, k, v, lse, delta, q_pos, k_pos, dq, dk, dv,
                             causal=causal, scale=scale, q_doc=q_doc, k_doc=k_doc, key=key,
                             config=config, visits=visits, window=window)
    _backward_kernel[launch.grid](*launch.args, **launch.kwargs)
    return dq, dk, dv


def backward_launch(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *, causal: bool, scale: float,
    q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, key: BlockPairKey | None,
    config: TileConfig | None, visits: torch.Tensor | None, window: int | None = None,
) -> KernelLaunch:
    """The backward kernel's launch for :func:`block_backward`'s arguments (accumulators
    allocated), transposed tile lists included."""
    batch, q_heads, sq, head_dim = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    cfg = config or kernel_configs(head_dim, q.dtype, q.device).backward
    t = step_tokens(q_pos, k_pos, q_doc, k_doc, q.device, causal=causal, block_m=cfg.block_m,
                    block_n=cfg.block_n, by_key=True, key=key, window=window)
    counter = visits if visits is not None else t.q_pos  # never written unless counting
    upcast, precision = dot_mode(q.dtype, q.device)
    return KernelLaunch(
        grid=(triton.cdiv(sk, cfg.block_n), batch * q_heads),
        args=(q, k, v, dout, lse, delta, dq, dk, dv, t.q_pos, t.k_pos, t.q_doc, t.k_doc,
              t.counts, t.indices, counter, *q.stride(), *k.stride(), *v.stride(),
              *dout.stride(), *lse.stride(), *delta.stride(), *dq.stride(), *dk.stride(),
              *dv.stride(), q_heads, q_heads // kv_heads, sq, sk, t.width, scale,
              scale * LOG2E, window or 0),
        kwargs={"CAUSAL": causal, "DOCS": t.docs, "WINDOW": window is not None,
                "MASKING": t.masking, "SHARED_KV": q_heads > kv_heads,
                "COUNT": visits is not None, "UPCAST": upcast, "PRECISION": precision,
                "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                "BLOCK_D": padded_head_dim(head_dim), "HEAD_DIM": head_dim,
                "num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
