"""The ``sdpa`` backend: PyTorch's own fused attention kernels, the ones that return an LSE.

On CPU it calls the flash kernel behind ``scaled_dot_product_attention``
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which skips key blocks
above the causal diagonal and takes an additive mask for the rare irregular piece. Half
inputs run in float32 on CPU: the CPU kernel has no faster half path (measured: bf16 and
fp32 take the same time), and float32 per-block partials keep the ring's merge exact.

On CUDA it calls the flash kernel for float16/bfloat16 full and causal pieces, and the
memory-efficient kernel (which takes a bias and float32) otherwise, with the bias and the LSE
laid out as public SDPA lays them out (expanded, rows padded to 16; LSE padded to 32); a masked
half-precision piece's backward runs that kernel in float32 (its half backward was wrong). A
masked piece's positions and document indices (host tensors) reach the GPU by pinned,
non-blocking copies (:func:`~.common.position_mask`), so building its mask does not wait for
the stream. The CUDA path needs a GPU to be exercised; its tests are marked ``gpu``.

Causal squares on CPU are cut into a quadtree (two causal halves and one full block,
recursively, down to :data:`CPU_CAUSAL_LEAF` rows). The CPU kernel tiles 256 queries by 512
keys and computes whole tiles on the diagonal, so its waste is a fixed number of keys per row:
small against a 16k sequence, large against a ring's 2k-4k blocks. Measured on this project's
CPU machine (1 thread, 8 heads, head_dim 64, forward + backward): a 4096 causal square took
0.728 s as one call and 0.664 s cut to 128-row leaves; a 16384 one took 10.31 s, so the cut
brings the per-pair cost of a ring block to within 3% of one whole-sequence call.

Grouped-query attention: K/V heads are repeated for the kernel call and the K/V gradients
summed back; the copy is linear in the block size while the kernel is quadratic.
"""

from __future__ import annotations

import torch

from ringray.attention.backends.common import (
    accumulation_dtype,
    expand_kv_heads,
    position_mask,
    reduce_kv_heads,
)
from ringray.attention.merge import merge_into
from ringray.attention.pieces import PieceKind

CPU_CAUSAL_LEAF = 128

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


class SdpaBackend:
    name = "sdpa"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type == "cpu":
            return dtype in (torch.float32, torch.float64, *_HALF)
        if device.type == "cuda":
            return dtype in (torch.float32, *_HALF)
        return False

    def forward(self, q, k, v, *, kind, scale, q_pos=None, k_pos=None, causal=True,
                q_doc=None, k_doc=None, window=None):
        allowed = _masked(kind, q_pos, k_pos, q.device, causal, q_doc, k_doc, window)
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        if q.device.type == "cpu":
            out, lse = _cpu_forward(q, k, v, kind, scale, allowed)
        else:
            out, lse = _cuda_forward(q, k, v, kind, scale, allowed)
        if allowed is not None:
            # The kernels leave a row that sees no key with lse 0; the merge rule needs -inf.
            empty = ~allowed.any(-1)
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty[:, None], 0.0)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, kind, scale, q_pos=None, k_pos=None,
                 causal=True, q_doc=None, k_doc=None, window=None):
        allowed = _masked(kind, q_pos, k_pos, q.device, causal, q_doc, k_doc, window)
        kv_heads = k.shape[1]
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        # A row that saw no key (lse -inf) is fully masked: with lse 0 its probabilities are
        # exp(-inf - 0) = 0 and its gradients exactly zero, where -inf would give NaN.
        lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = _cpu_backward(dout, q, k, v, out, lse, kind, scale, allowed)
        else:
            dq, dk, dv = _cuda_backward(dout, q, k, v, out, lse, kind, scale, allowed)
        return dq, reduce_kv_heads(dk, kv_heads), reduce_kv_heads(dv, kv_heads)


def _masked(kind: PieceKind, q_pos, k_pos, device: torch.device, causal: bool, q_doc,
            k_doc, window: int | None) -> torch.Tensor | None:
    """The boolean mask of a MASKED piece (None for the other kinds)."""
    if kind is not PieceKind.MASKED:
        return None
    return position_mask(q_pos, k_pos, device, causal=causal, q_doc=q_doc, k_doc=k_doc,
                         window=window)


def _additive_mask(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, float("-inf")
    )


def _cpu_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def causal_quadtree(size: int, leaf: int, offset: int = 0) -> list[tuple[bool, int, int, int]]:
    """Cover a causal square with (is_causal, row_start, row_end, key_start) pieces: causal
    squares of at most ``leaf`` rows on the diagonal and full blocks below them. A full
    piece's keys end where its rows start."""
    if size <= leaf:
        return [(True, offset, offset + size, offset)]
    half = size // 2
    return [
        *causal_quadtree(half, leaf, offset),
        (False, offset + half, offset + size, offset),
        *causal_quadtree(size - half, leaf, offset + half),
    ]


def _cpu_pieces(kind: PieceKind, q_len: int, k_len: int) -> list[tuple[bool, int, int, int, int]]:
    """(is_causal, rows, keys) calls that cover one piece on the CPU kernel."""
    if kind is not PieceKind.CAUSAL or q_len <= CPU_CAUSAL_LEAF:
        return [(kind is PieceKind.CAUSAL, 0, q_len, 0, k_len)]
    return [
        (causal, r0, r1, k0, r1 if causal else r0)
        for causal, r0, r1, k0 in causal_quadtree(q_len, CPU_CAUSAL_LEAF)
    ]


def _cpu_forward(q, k, v, kind, scale, allowed):
    dt = _cpu_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    mask = _additive_mask(allowed, dt)
    pieces = _cpu_pieces(kind, q.shape[2], k.shape[2])
    if len(pieces) == 1:
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, pieces[0][0], attn_mask=mask, scale=scale
        )
    acc = accumulation_dtype(dt)
    out = torch.zeros(q.shape, dtype=acc)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc)
    for causal, r0, r1, k0, k1 in pieces:
        part_out, part_lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, r0:r1], k[:, :, k0:k1], v[:, :, k0:k1], 0.0, causal, scale=scale
        )
        merge_into(out[:, :, r0:r1], lse[:, :, r0:r1], part_out, part_lse)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, kind, scale, allowed):
    dt = _cpu_dtype(q.dtype)
    dout, q, k, v, out = dout.to(dt), q.to(dt), k.to(dt), v.to(dt), out.to(dt)
    lse = lse.to(torch.float64 if dt == torch.float64 else torch.float32)
    mask = _additive_mask(allowed, dt)
    pieces = _cpu_pieces(kind, q.shape[2], k.shape[2])
    if len(pieces) == 1:
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, pieces[0][0], attn_mask=mask, scale=scale
        )
    # With the final out/lse given, each piece's gradients are exact partial sums.
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for causal, r0, r1, k0, k1 in pieces:
        rows, keys = slice(r0, r1), slice(k0, k1)
        part = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
            lse[:, :, rows].contiguous(), 0.0, causal, scale=scale,
        )
        dq[:, :, rows] += part[0]
        dk[:, :, keys] += part[1]
        dv[:, :, keys] += part[2]
    return dq, dk, dv


def _use_flash(q: torch.Tensor, allowed: torch.Tensor | None) -> bool:
    return q.dtype in _HALF and allowed is None


# The memory-efficient kernel reads its bias with 16-element aligned rows and returns its LSE
# padded to a multiple of 32 queries; public SDPA prepares both (torch's sdpa_utils), and so
# must a direct call, or it fails ("misaligned address") or reads the wrong stride.
_BIAS_ALIGN = 16
_LSE_ALIGN = 32


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cuda_bias(allowed: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor
               ) -> torch.Tensor | None:
    """The additive mask as the efficient kernel wants it: ``(batch, heads, q, k)`` (expanded,
    no copy) over storage whose rows are padded to 16 elements, as public SDPA passes it."""
    if allowed is None:
        return None
    q_len, k_len = allowed.shape
    padded = torch.full((q_len, _round_up(k_len, _BIAS_ALIGN)), float("-inf"), dtype=q.dtype,
                        device=q.device)
    padded[:, :k_len].masked_fill_(allowed, 0.0)
    return padded[:, :k_len].expand(q.shape[0], q.shape[1], q_len, k_len)


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` ``(batch, heads, q)`` laid out as the efficient kernel returned it (padded to 32
    queries), for its backward."""
    q_len = lse.shape[-1]
    pad = _round_up(q_len, _LSE_ALIGN) - q_len
    return torch.nn.functional.pad(lse.float(), (0, pad)) if pad else lse.float().contiguous()


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CUDA flash kernel (float16/bfloat16, K/V at the query head count): ``(out,
    lse)``, a causal square top-left aligned. Also the ``flash`` kernel of :mod:`.dense`."""
    result = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return result[0], result[1]


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash kernel's backward given the *final* ``out`` and ``lse`` (float32) of the
    rows: ``(dq, dk, dv)`` at the query head count."""
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)
    # None passes an undefined tensor, as autograd does: the kernel reads a *defined* empty
    # cum_seq as a variable-length batch ("batch size must be positive"), seen on an H200.
    return _aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.float().contiguous(), None, None,
        q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale,
    )


def _cuda_forward(q, k, v, kind, scale, allowed):
    causal = kind is PieceKind.CAUSAL
    if _use_flash(q, allowed):
        return flash_forward(q, k, v, causal=causal, scale=scale)
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, k, v, _cuda_bias(allowed, q, k), True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]  # the efficient kernel pads lse to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, kind, scale, allowed):
    causal = kind is PieceKind.CAUSAL
    if _use_flash(q, allowed):
        return flash_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    out = out.to(q.dtype)
    dout = dout.to(q.dtype)
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)
    # None passes an undefined tensor, as autograd does: the kernel reads a defined empty
    # bias as a malformed one ("Bias expected in BMHK format"), seen on an H200 (torch 2.11).
    # A masked piece in half precision is differentiated in float32: the efficient kernel's
    # half backward with a bias gave wrong dQ/dK on an H200 (torch 2.11; dV right, dQ off by
    # up to 2.0 where public SDPA was right), and its float32 backward matched float64. The
    # masked pieces are the rare irregular ones; full and causal pieces keep the flash kernel.
    work = torch.float32 if q.dtype in _HALF else q.dtype
    dout, q32, k, v, out = (t.to(work) for t in (dout, q, k, v, out))
    grads = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q32, k, v, _cuda_bias(allowed, q32, k), out, _padded_lse(lse), no_rng, no_rng,
        0.0, [True, True, True, False], causal, scale=scale,
    )
    return tuple(g.to(q.dtype) for g in grads[:3])
