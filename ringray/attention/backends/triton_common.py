"""Pieces shared by the Triton forward and backward kernels.

- :func:`mma`: the one matrix multiply both kernels use, ``acc + a @ b`` in float32.
- :func:`load_tokens` and :func:`visible`: the per-token mask of a straddling tile pair
  (``q_pos >= k_pos`` when causal, within a sliding window, equal document indices with
  documents).
- :func:`dot_mode`: how ``mma`` multiplies for a dtype on a device (see below).
- :class:`KernelLaunch`: one launch's grid and arguments, built apart from running it (so
  that :mod:`.triton_inspect` can compile exactly what would run).
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
def visible(q_pos, k_pos, q_doc, k_doc, window, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
            WINDOW: tl.constexpr):
    """Where a query sees a key (broadcast operands): ``q_pos >= k_pos`` when ``CAUSAL``,
    ``q_pos - k_pos < window`` when ``WINDOW`` (set only with ``CAUSAL``) and ``q_doc ==
    k_doc`` when ``DOCS`` (at least one of ``CAUSAL`` and ``DOCS`` is set)."""
    if CAUSAL:
        ok = q_pos >= k_pos
        if WINDOW:
            ok = ok & (q_pos - k_pos < window)
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


@dataclass(frozen=True)
class KernelLaunch:
    """A kernel launch without the kernel: ``kernel[grid](*args, **kwargs)``. ``kwargs``
    holds the constexpr parameters and ``num_warps``/``num_stages``."""

    grid: tuple[int, int]
    args: tuple[torch.Tensor | int | float, ...]
    kwargs: dict[str, bool | int | str]


def kernels_interpreted() -> bool:
    """Whether ``@triton.jit`` builds interpreted kernels here (``TRITON_INTERPRET=1`` was
    set before the kernels were defined): then they run on CPU tensors, slowly."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(mma, InterpretedFunction)
