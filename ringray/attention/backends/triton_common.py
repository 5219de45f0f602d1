"""Pieces shared by the Triton forward and backward kernels.

- :func:`mma`: the one matrix multiply both kernels use, ``acc + a @ b`` in float32.
- :func:`tile_ranges` and :class:`TokenTiles`: the compact description of a block's tokens
  (positions, document indices, their per-tile ranges) the kernels classify tiles with.
- :func:`classify_tile_pair`: the one rule that says which (query, key) tile pairs run, and
  which of those need the per-token mask (forward, dK/dV and dQ all ask it); with packed
  documents it also reads the tiles' document ranges.
- :func:`load_tokens` and :func:`visible`: the per-token mask of a straddling tile pair
  (``q_pos >= k_pos`` when causal, equal document indices with documents).
- :func:`dot_mode`: how ``mma`` multiplies for a dtype on a device (see below).
- :func:`kernels_interpreted`: whether the kernels run in Triton's interpreter (CPU).

Why ``mma`` can upcast: Triton's interpreter (``TRITON_INTERPRET=1``, the only way these
kernels run on CPU tensors) stores bfloat16 as ``uint16`` and its ``tl.dot`` passes those
arrays straight to ``np.matmul``, so it multiplies the raw bit patterns (1.0 is 16256):
results around 1e9 while every other bf16 operation (loads, casts, stores) is right.
Upstream: triton-lang/triton#11584 (the fix, #11585, was declined: the interpreter does not
support bf16 dots "yet"). On CPU, bf16 operands are therefore converted to float32 just
before the multiply. That is the arithmetic a GPU's bf16 MMA performs (bf16 × bf16 products
are exact in float32, accumulated in float32), and the operands are still rounded to bf16
first (``p.to(v.dtype)`` and friends), so the interpreter tests keep checking the bf16
kernel's rounding. On CUDA the flag is off and the compiled kernel is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The kernels work in base 2 (exp2/log2); LSE crosses their boundary in base e.
LOG2E = 1 / math.log(2)  # host side: folded into the scale
KERNEL_LOG2E = tl.constexpr(LOG2E)  # inside kernels: natural-log LSE in
LN2 = tl.constexpr(math.log(2))  # inside kernels: natural-log LSE out

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` (float32 result); ``UPCAST`` works around the interpreter's bf16 dot."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def classify_tile_pair(QMIN, QMAX, KMIN, KMAX, QDMIN, QDMAX, KDMIN, KDMAX, tile_m, tile_n,
                       CAUSAL: tl.constexpr, DOCS: tl.constexpr):
    """``(runs, straddles)`` for query tile ``tile_m`` and key tile ``tile_n``, from the
    tiles' position ranges (``QMIN``... , :func:`tile_ranges`) under the causal rule
    ``q_pos >= k_pos`` when ``CAUSAL``, and from their document-index ranges (``QDMIN``...)
    when ``DOCS`` (a query sees only keys of its own document).

    ``runs`` is false when every key comes after every query, or every key lies in another
    document than every query: the pair is empty, skipped without loading anything.
    ``straddles`` is true unless every query sees every key (one document on both sides
    and, causal, every key at or before every query): then the scores need the per-token
    mask (:func:`visible`); a pair that runs and does not straddle is computed unmasked.
    The step planner's form of this rule is ``ringray.attention.steps.classify_tiles``.
    """
    runs = tile_n >= 0  # true, as a tensor like the comparisons below
    straddles = tile_n < 0
    if CAUSAL:
        q_lo = tl.load(QMIN + tile_m)
        q_hi = tl.load(QMAX + tile_m)
        k_lo = tl.load(KMIN + tile_n)
        k_hi = tl.load(KMAX + tile_n)
        runs = k_lo <= q_hi
        straddles = k_hi > q_lo
    if DOCS:
        qd_lo = tl.load(QDMIN + tile_m)
        qd_hi = tl.load(QDMAX + tile_m)
        kd_lo = tl.load(KDMIN + tile_n)
        kd_hi = tl.load(KDMAX + tile_n)
        runs = runs & (kd_lo <= qd_hi) & (kd_hi >= qd_lo)
        straddles = straddles | (qd_lo != qd_hi) | (kd_lo != kd_hi) | (qd_lo != kd_lo)
    return runs, straddles


@triton.jit
def load_tokens(POS, DOC, idx, ok, other, CAUSAL: tl.constexpr, DOCS: tl.constexpr):
    """``(positions, document indices)`` of tokens ``idx`` (``other`` where not ``ok``), for
    :func:`visible`; the one a mode does not compare is ``idx`` itself, never read."""
    pos = idx
    doc = idx
    if CAUSAL:
        pos = tl.load(POS + idx, mask=ok, other=other)
    if DOCS:
        doc = tl.load(DOC + idx, mask=ok, other=other)
    return pos, doc


@triton.jit
def visible(q_pos, k_pos, q_doc, k_doc, CAUSAL: tl.constexpr, DOCS: tl.constexpr):
    """Where a query sees a key (broadcast operands): ``q_pos >= k_pos`` when ``CAUSAL`` and
    ``q_doc == k_doc`` when ``DOCS`` (at least one of them is set)."""
    if CAUSAL:
        ok = q_pos >= k_pos
        if DOCS:
            ok = ok & (q_doc == k_doc)
    else:
        ok = q_doc == k_doc
    return ok


def dot_mode(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """``(UPCAST, PRECISION)`` for :func:`mma`: float32 inputs multiply in full IEEE float32
    (not TF32: the ring's float32 path promises float32 accuracy); bf16 on CPU upcasts."""
    upcast = device.type == "cpu" and dtype == torch.bfloat16
    return upcast, "ieee" if upcast or dtype == torch.float32 else "tf32"


def padded_head_dim(head_dim: int) -> int:
    """The tile width the kernels use for ``head_dim`` (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(head_dim))


def tile_ranges(positions: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile minimum and maximum of int32 ``positions`` (global positions or document
    indices; the last tile may be short), int32."""
    n = positions.numel()
    tiles = -(-n // block)
    padded_min = torch.full((tiles * block,), torch.iinfo(torch.int32).max, dtype=torch.int32,
                            device=positions.device)
    padded_max = torch.full((tiles * block,), -1, dtype=torch.int32, device=positions.device)
    padded_min[:n] = positions
    padded_max[:n] = positions
    return (padded_min.view(tiles, block).amin(1).contiguous(),
            padded_max.view(tiles, block).amax(1).contiguous())


def positions_int32(positions: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Global positions as the contiguous int32 device tensor the kernels read."""
    return positions.to(device=device, dtype=torch.int32).contiguous()


@dataclass(frozen=True)
class TokenTiles:
    """One side of a block pair as the kernels see it: the tokens' global positions and
    document indices (contiguous int32 on the device) and their per-tile minima and maxima.
    Without documents the document fields repeat the position fields (never read)."""

    pos: torch.Tensor
    pos_min: torch.Tensor
    pos_max: torch.Tensor
    doc: torch.Tensor
    doc_min: torch.Tensor
    doc_max: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.pos_min.numel()


def token_tiles(positions: torch.Tensor, documents: torch.Tensor | None, block: int,
                device: torch.device) -> TokenTiles:
    """:class:`TokenTiles` of a block cut into tiles of ``block`` tokens."""
    pos = positions_int32(positions, device)
    pos_min, pos_max = tile_ranges(pos, block)
    if documents is None:
        return TokenTiles(pos, pos_min, pos_max, pos, pos_min, pos_max)
    doc = positions_int32(documents, device)
    return TokenTiles(pos, pos_min, pos_max, doc, *tile_ranges(doc, block))


def tile_args(q: TokenTiles, k: TokenTiles) -> tuple[torch.Tensor, ...]:
    """The kernels' token arguments, in their order: ``QPOS, KPOS, QMIN, QMAX, KMIN, KMAX,
    QDOC, KDOC, QDMIN, QDMAX, KDMIN, KDMAX``."""
    return (q.pos, k.pos, q.pos_min, q.pos_max, k.pos_min, k.pos_max,
            q.doc, k.doc, q.doc_min, q.doc_max, k.doc_min, k.doc_max)


def kernels_interpreted() -> bool:
    """Whether ``@triton.jit`` builds interpreted kernels here (``TRITON_INTERPRET=1`` was
    set before the kernels were defined): then they run on CPU tensors, slowly."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(mma, InterpretedFunction)
