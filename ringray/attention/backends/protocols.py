"""What a kernel backend offers the ring: the interfaces, apart from any kernel.

- :class:`BlockAttentionBackend`: one planned piece (every :class:`PieceKind`), forward and
  backward, the output with its natural-log LSE. Every backend has it.
- :class:`FusedStepBackend`: an optional capability, whole ring-step blocks addressed by
  global positions (``triton``).
- :class:`DenseKernel`: the unmasked piece kinds only (``FULL``, ``CAUSAL``): the library
  kernels of :mod:`.dense`, among which :mod:`.routed` measures the fastest.

They live here, below the backends, so that a backend module can name them without importing
the package that registers it (``ringray.attention.backends`` re-exports them).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ringray.attention.backends.common import BlockPairKey
from ringray.attention.pieces import PieceKind


class BlockAttentionBackend(Protocol):
    name: str

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this backend can run every piece kind on this device and dtype."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
        scale: float, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
        causal: bool = True, q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None, window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: out ``(B, Hq, Sq, D)``, lse ``(B, Hq, Sq)`` float32/64.

        A ``MASKED`` piece's mask comes from the tokens' global positions (``q_pos >= k_pos``
        when ``causal``, ``q_pos - k_pos <= window - 1`` with a sliding ``window``) and,
        with packed documents, their document indices (equal);
        :func:`~.common.position_mask` is the rule. Other kinds ignore them."""
        ...

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float,
        q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
        causal: bool = True, q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None, window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` with dk/dv at the kv-head count (mask as in :meth:`forward`)."""
        ...


@runtime_checkable
class FusedStepBackend(Protocol):
    """Optional capability: one call per ring step and direction, on whole blocks.

    Positions are the blocks' global token positions (int32 on the tensors' device); the
    causal rule ``q_pos >= k_pos`` (and a sliding ``window``: ``q_pos - k_pos <= window -
    1``) is applied by the kernel, and with packed documents ``q_doc``/``k_doc`` (the
    tokens' document indices, int32) confine attention to a document. ``key`` names the
    block pair's tokens (:class:`~.common.BlockPairKey`) so a backend may cache what it
    derives from them (Triton's tile lists). Accumulators are float32: ``out``/``dq``
    ``(B, Hq, Sq, D)``, ``lse``/``delta`` ``(B, Hq, Sq)``, ``dk``/``dv`` ``(B, Hkv, Sk, D)``.
    """

    def forward_into(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float,
        q_pos: torch.Tensor, k_pos: torch.Tensor,
        q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
        key: BlockPairKey | None = None, window: int | None = None,
    ) -> None:
        """Merge this block's attention into ``(out, lse)`` (initially 0 / -inf) in place."""
        ...

    def backward_into(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        lse: torch.Tensor, delta: torch.Tensor,
        dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
        causal: bool, scale: float, q_pos: torch.Tensor, k_pos: torch.Tensor,
        q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
        key: BlockPairKey | None = None, window: int | None = None,
    ) -> None:
        """Add this block's gradients to ``dq, dk, dv``, given the final ``lse`` and
        ``delta = rowsum(dout * out)`` (:func:`~.common.softmax_delta`; a backend may
        compute it itself with an optional ``delta(dout, out)`` method, which the ring then
        calls once per call: :func:`~.common.backend_delta`)."""
        ...


class DenseKernel(Protocol):
    """A kernel for the unmasked piece kinds: ``FULL`` and ``CAUSAL`` (a square, query i
    seeing keys 0..i). Tensors and results as in :class:`BlockAttentionBackend`; the
    backward takes the ring's *final* out and LSE of the rows (any layout, LSE float32)."""

    name: str

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether it runs here: device type, dtype, and the library being built or
        installed (and the GPU new enough, where one is visible)."""
        ...

    def supports_head_dim(self, head_dim: int) -> bool:
        """Whether it takes this head dimension."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of a ``FULL`` or ``CAUSAL`` piece."""
        ...

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)``, dk/dv at the kv-head count."""
        ...
