"""The ``triton`` backend: the project's own position-aware kernels for ring steps.

Two ways in:

- the plain :class:`~ringray.attention.backends.BlockAttentionBackend` interface
  (``forward``/``backward`` of one planned piece), so it drops in wherever ``sdpa`` does;
- the fused ring-step capability (:class:`~ringray.attention.backends.FusedStepBackend`):
  ``forward_into`` attends a whole query block to a whole K/V block by their *global
  positions* and merges into the ring's float32 (out, LSE) accumulators in the same kernel;
  ``backward_into`` adds the block's dQ/dK/dV to float32 accumulators, given the ring's
  final LSE and ``delta = rowsum(dO * O)`` computed once per ring call, by :meth:`delta`
  (one small kernel over the ring's transposed views, no float32 copies). The ring uses
  this path whenever a backend offers it: one kernel launch per step and direction instead
  of one per planned piece plus a merge pass.

Tile classification from positions (empty / full / straddling, see :mod:`.triton_tiles`)
replaces the planner's pieces, so every layout, regular or not, runs without a dense mask.
The fused methods take an optional ``key`` (:class:`~.common.BlockPairKey`: layout,
query rank, key rank, documents) naming the block pair's tokens; with it, the tile lists are
built once per block pair, tile shape and device and then come from a cache.

Runs on CUDA (float16, bfloat16, float32) and, for tests, on CPU in Triton's interpreter
when ``TRITON_INTERPRET=1`` was set before the kernels were defined.
"""

from __future__ import annotations

import torch

from ringray.attention.backends.common import BlockPairKey
from ringray.attention.backends.triton_backward import block_backward, softmax_delta_triton
from ringray.attention.backends.triton_common import SUPPORTED_DTYPES, kernels_interpreted
from ringray.attention.backends.triton_forward import block_forward
from ringray.attention.pieces import PieceKind


class TritonBackend:
    name = "triton"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        if dtype not in SUPPORTED_DTYPES:
            return False
        return device.type == "cuda" or (device.type == "cpu" and kernels_interpreted())

    def forward(self, q, k, v, *, kind, scale, q_pos=None, k_pos=None, causal=True,
                q_doc=None, k_doc=None, window=None):
        mask = _piece_mask(kind, q, k, q_pos, k_pos, causal, q_doc, k_doc, window)
        return block_forward(q, k, v, scale=scale, **mask)

    def backward(self, dout, q, k, v, out, lse, *, kind, scale, q_pos=None, k_pos=None,
                 causal=True, q_doc=None, k_doc=None, window=None):
        mask = _piece_mask(kind, q, k, q_pos, k_pos, causal, q_doc, k_doc, window)
        return block_backward(dout, q, k, v, lse.float().contiguous(), self.delta(dout, out),
                              scale=scale, **mask)

    def delta(self, dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``rowsum(dout * out)``, float32 ``(batch, heads, seq)``, for :meth:`backward_into`:
        ``dout`` and ``out`` ``(batch, heads, seq, d)`` in any dtype and strides, read as
        they are (:func:`~.triton_backward.softmax_delta_triton`)."""
        return softmax_delta_triton(dout, out)

    def forward_into(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float,
        q_pos: torch.Tensor, k_pos: torch.Tensor,
        q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
        key: BlockPairKey | None = None, window: int | None = None,
    ) -> None:
        block_forward(q, k, v, q_pos, k_pos, causal=causal, scale=scale, q_doc=q_doc,
                      k_doc=k_doc, out=out, lse=lse, key=key, window=window)

    def backward_into(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        lse: torch.Tensor, delta: torch.Tensor,
        dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
        causal: bool, scale: float, q_pos: torch.Tensor, k_pos: torch.Tensor,
        q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
        key: BlockPairKey | None = None, window: int | None = None,
    ) -> None:
        block_backward(dout, q, k, v, lse, delta, q_pos, k_pos, causal=causal, scale=scale,
                       q_doc=q_doc, k_doc=k_doc, dq=dq, dk=dk, dv=dv, key=key, window=window)


def _piece_mask(kind: PieceKind, q: torch.Tensor, k: torch.Tensor,
                q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, causal: bool,
                q_doc: torch.Tensor | None, k_doc: torch.Tensor | None,
                window: int | None) -> dict:
    """The kernels' mask arguments for one planned piece: a MASKED piece's own positions
    (and documents, and window); a CAUSAL square top-left aligned (query i sees keys 0..i);
    a FULL piece needs no mask."""
    if kind is PieceKind.MASKED:
        return {"q_pos": q_pos, "k_pos": k_pos, "causal": causal, "q_doc": q_doc,
                "k_doc": k_doc, "window": window}
    q_idx = torch.arange(q.shape[2], device=q.device)
    k_idx = torch.arange(k.shape[2], device=q.device)
    return {"q_pos": q_idx, "k_pos": k_idx, "causal": kind is PieceKind.CAUSAL}
