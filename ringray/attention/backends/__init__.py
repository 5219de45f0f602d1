"""Local block-attention backends behind one interface.

A backend computes attention of a query block against one key/value block, for one
:class:`~ringray.attention.pieces.PieceKind`, and returns the output with its natural-log LSE;
its backward takes the *final* (ring-global) output and LSE of those query rows, which makes
the per-block gradients exact partial sums (the flash-attention backward identity).

Tensors are ``(batch, heads, seq, head_dim)``; ``k``/``v`` carry the kv-head count and the
backend handles grouped-query attention itself. Outputs may come back in a wider dtype than
the inputs; the ring accumulates them in float32 (float64 for float64 inputs).

Backends: ``reference`` (materialised scores, any mask, float64; for tests), ``sdpa``
(PyTorch's fused flash/efficient kernels, CPU and CUDA), ``triton`` (the project's own
position-aware kernels; CUDA, and CPU under ``TRITON_INTERPRET=1`` for tests). ``auto``
picks ``triton`` on CUDA when the triton package is importable, else ``sdpa``.

A backend may also offer the optional :class:`FusedStepBackend` capability (``triton``
does): whole ring-step blocks addressed by global positions, accumulated in place. The ring
checks for it with ``isinstance`` and otherwise calls ``forward``/``backward`` per planned
piece and merges with :func:`~ringray.attention.merge.merge_into`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import torch

from ringray.attention.backends.common import BlockPairKey
from ringray.attention.backends.reference import ReferenceBackend
from ringray.attention.backends.sdpa import SdpaBackend
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
        ``delta = rowsum(dout * out)`` (:func:`~.common.softmax_delta`)."""
        ...


def _triton_backend() -> BlockAttentionBackend:
    from ringray.attention.backends.triton import TritonBackend  # needs the triton package

    return TritonBackend()


BACKENDS: Mapping[str, Callable[[], BlockAttentionBackend]] = MappingProxyType(
    {"reference": ReferenceBackend, "sdpa": SdpaBackend, "triton": _triton_backend}
)


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def auto_candidates(device: torch.device) -> tuple[str, ...]:
    """Backends ``auto`` tries in order: ``triton`` first on CUDA when it is installed."""
    if device.type == "cuda" and triton_importable():
        return ("triton", "sdpa", "reference")
    return ("sdpa", "reference")


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> BlockAttentionBackend:
    """The backend called ``name`` (or the best one for ``auto``), checked for support."""
    if name == "auto":
        for candidate in auto_candidates(device):
            backend = BACKENDS[candidate]()
            if backend.supports(device, dtype):
                return backend
        raise ValueError(f"backend: no backend supports {dtype} on {device.type}")
    if name not in BACKENDS:
        valid = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"backend: unknown backend {name!r}; valid: {valid}")
    if name == "triton" and not triton_importable():
        raise ValueError("backend: 'triton' needs the triton package (pip install triton)")
    backend = BACKENDS[name]()
    if not backend.supports(device, dtype):
        raise ValueError(f"backend: {name!r} does not support {dtype} on {device.type}")
    return backend

