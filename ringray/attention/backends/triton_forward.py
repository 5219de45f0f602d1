"""Triton forward kernel for one ring step: position-aware tile skipping and a fused merge.

    out, lse = block_forward(q, k, v, q_pos, k_pos, causal=True, scale=0.125)
    block_forward(q, k, v, q_pos, k_pos, causal=True, scale=s, out=acc_out, lse=acc_lse)

``q`` is ``(batch, q_heads, sq, d)``, ``k``/``v`` ``(batch, kv_heads, sk, d)`` (any strides,
so the ring's transposed views need no copy); GQA/MQA by indexing the kv head. ``q_pos`` and
``k_pos`` are the tokens' global positions. Each (query tile, key tile) pair is classified
from per-tile position ranges computed once on the host: *empty* (every key after every
query: skipped, never loaded), *full* (every key at or before every query: no mask) or
*straddling* (the only tiles that load positions and apply ``q_pos >= k_pos``).

With ``out``/``lse`` given (float32, ``(batch, q_heads, sq, d)`` / ``(batch, q_heads, sq)``),
the block's result is merged into them in place with the log-sum-exp rule: the ring step's
merge costs no extra pass. Rows that see no key keep ``lse = -inf`` and output 0.

Work in progress for issue 3: forward only, not yet registered as a backend. Runs on CPU
under ``TRITON_INTERPRET=1``; its speed is only meaningful on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1 / math.log(2)
_LN2 = tl.constexpr(math.log(2))  # the kernel works in base 2; its LSE comes out in base e


@triton.jit
def _forward_kernel(
    Q, K, V, QPOS, KPOS, QMIN, QMAX, KMIN, KMAX, OUT, LSE, VISITS,
    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sob, soh, sos, sod, slb, slh, sls,
    q_heads, group, sq, sk, num_k_tiles, scale_log2,
    CAUSAL: tl.constexpr, MERGE: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
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
    if CAUSAL:
        q_pos = tl.load(QPOS + rows, mask=row_ok, other=-1)
        q_lo = tl.load(QMIN + tile_m)
        q_hi = tl.load(QMAX + tile_m)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    visited = tl.sum(tl.zeros([1], tl.int32), 0)
    for tile_n in range(0, num_k_tiles):
        run = True
        straddles = False
        if CAUSAL:
            k_lo = tl.load(KMIN + tile_n)
            k_hi = tl.load(KMAX + tile_n)
            run = k_lo <= q_hi  # otherwise every key is after every query: skip the tile
            straddles = k_hi > q_lo
        if run:
            visited += 1
            cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < sk
            k = tl.load(
                K + b * skb + kv_h * skh + cols[None, :] * sks + dims[:, None] * skd,
                mask=col_ok[None, :] & dim_ok[:, None], other=0.0,
            )
            scores = tl.dot(q, k).to(tl.float32) * scale_log2  # base-2 exponent units
            allowed = col_ok[None, :] & row_ok[:, None]
            if straddles:
                k_pos = tl.load(KPOS + cols, mask=col_ok, other=0)
                allowed = allowed & (q_pos[:, None] >= k_pos[None, :])
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
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    block_out = acc / l_safe[:, None]
    block_lse = tl.where(seen, (m_i + tl.log2(l_safe)) * _LN2, float("-inf"))
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
        merged_lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)),
                              float("-inf"))
        denom = tl.where(total > 0, total, 1.0)
        merged = (old_out * w_old[:, None] + block_out * w_new[:, None]) / denom[:, None]
        tl.store(out_ptrs, merged, mask=io_mask)
        tl.store(lse_ptrs, merged_lse, mask=row_ok)
    else:
        tl.store(out_ptrs, block_out, mask=io_mask)
        tl.store(lse_ptrs, block_lse, mask=row_ok)
    if COUNT:
        tl.atomic_add(VISITS, visited)


def tile_ranges(positions: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile minimum and maximum global position (the last tile may be short)."""
    n = positions.numel()
    tiles = -(-n // block)
    padded_min = torch.full((tiles * block,), torch.iinfo(torch.int32).max, dtype=torch.int32,
                            device=positions.device)
    padded_max = torch.full((tiles * block,), -1, dtype=torch.int32, device=positions.device)
    padded_min[:n] = positions
    padded_max[:n] = positions
    return (padded_min.view(tiles, block).amin(1).contiguous(),
            padded_max.view(tiles, block).amax(1).contiguous())


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_pos: torch.Tensor, k_pos: torch.Tensor, *,
    causal: bool, scale: float,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    block_m: int = 32, block_n: int = 32, visits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one K/V block; merged into ``out``/``lse`` when given.

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
    q_pos32 = q_pos.to(device=q.device, dtype=torch.int32).contiguous()
    k_pos32 = k_pos.to(device=q.device, dtype=torch.int32).contiguous()
    q_min, q_max = tile_ranges(q_pos32, block_m)
    k_min, k_max = tile_ranges(k_pos32, block_n)
    counter = visits if visits is not None else torch.zeros(1, dtype=torch.int32,
                                                            device=q.device)
    grid = (q_min.numel(), batch * q_heads)
    _forward_kernel[grid](
        q, k, v, q_pos32, k_pos32, q_min, q_max, k_min, k_max, out, lse, counter,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        q_heads, q_heads // kv_heads, sq, sk, k_min.numel(), scale * _LOG2E,
        CAUSAL=causal, MERGE=merge, COUNT=visits is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HEAD_DIM=head_dim,
    )
    return out, lse
