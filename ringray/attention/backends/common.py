"""Helpers shared by the block-attention backends."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ringray.attention.documents import Documents
    from ringray.attention.layouts import Layout


def triton_importable() -> bool:
    """Whether the triton package is installed (its kernels are defined on first use)."""
    return importlib.util.find_spec("triton") is not None


def upload(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """``tensor`` (on the host) moved to ``device``, without a stream synchronisation: on CUDA
    through pinned memory with ``non_blocking`` (a pageable copy waits for the stream), which
    the caching host allocator keeps alive until the copy is done."""
    if dtype is not None:
        tensor = tensor.to(dtype)
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def expand_kv_heads(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Repeat kv heads so each query head has its own copy (GQA/MQA for kernels that lack it)."""
    groups = q_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_kv_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum per-query-head K/V gradients back onto their shared kv head."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def position_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, device: torch.device, *,
    causal: bool = True, q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``(Sq, Sk)`` bool: True where query may see key: ``q_pos >= k_pos`` when ``causal``,
    ``q_pos - k_pos <= window - 1`` with a sliding ``window``, and the same document when
    document indices are given (:mod:`ringray.attention.documents`). Host tensors go to a
    CUDA ``device`` through :func:`upload` (pinned, no stream synchronisation).
    """
    q_pos, k_pos = upload(q_pos, device), upload(k_pos, device)
    if causal:
        allowed = q_pos[:, None] >= k_pos[None, :]
    else:
        allowed = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=device)
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] <= window - 1
    if q_doc is not None and k_doc is not None:
        allowed &= upload(q_doc, device)[:, None] == upload(k_doc, device)[None, :]
    return allowed


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dout * out)``, ``(..., seq)``, in the accumulation dtype: the attention
    backward's per-row term, over the *final* output. A ring computes it once per call."""
    acc = accumulation_dtype(dout.dtype)
    return torch.einsum("...sd,...sd->...s", dout.to(acc), out.to(acc))


def backend_delta(backend: object, dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`softmax_delta` as ``backend`` computes it: its own ``delta(dout, out)`` where it
    has one (Triton's small kernel reads both in their dtypes and strides, no float32
    copies), else the torch expression."""
    own = getattr(backend, "delta", None)
    return own(dout, out) if own is not None else softmax_delta(dout, out)


@dataclass(frozen=True)
class BlockPairKey:
    """Names the tokens of one ring step's block pair, for the cache: the queries are
    ``layout.positions(q_rank)``, the keys ``layout.positions(k_rank)``, and with
    ``documents`` their document indices are ``documents.ids`` at those positions. The
    caller promises that the tensors it passes along are exactly those. Layouts are
    immutable and compare by identity (``make_layout`` memoises them); documents compare by
    their lengths."""

    layout: Layout
    q_rank: int
    k_rank: int
    documents: Documents | None = None
