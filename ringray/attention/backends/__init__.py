"""Local block-attention backends behind one interface.

A backend computes attention of a query block against one key/value block, for one
:class:`~ringray.attention.plan.PieceKind`, and returns the output with its natural-log LSE;
its backward takes the *final* (ring-global) output and LSE of those query rows, which makes
the per-block gradients exact partial sums (the flash-attention backward identity).

Tensors are ``(batch, heads, seq, head_dim)``; ``k``/``v`` carry the kv-head count and the
backend handles grouped-query attention itself. Outputs may come back in a wider dtype than
the inputs; the ring accumulates them in float32 (float64 for float64 inputs).

Backends: ``reference`` (materialised scores, any mask, float64; for tests), ``sdpa``
(PyTorch's fused flash/efficient kernels, CPU and CUDA). ``triton`` and ``flash_attn`` slot
in here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import torch

from ringray.attention.backends.reference import ReferenceBackend
from ringray.attention.backends.sdpa import SdpaBackend
from ringray.attention.plan import PieceKind


class BlockAttentionBackend(Protocol):
    name: str

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this backend can run every piece kind on this device and dtype."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
        scale: float, q_pos: torch.Tensor | None, k_pos: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: out ``(B, Hq, Sq, D)``, lse ``(B, Hq, Sq)`` float32/64."""
        ...

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float,
        q_pos: torch.Tensor | None, k_pos: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` with dk/dv at the kv-head count."""
        ...


BACKENDS: Mapping[str, Callable[[], BlockAttentionBackend]] = MappingProxyType(
    {"reference": ReferenceBackend, "sdpa": SdpaBackend}
)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> BlockAttentionBackend:
    """The backend called ``name`` (or the best one for ``auto``), checked for support."""
    if name == "auto":
        for candidate in ("sdpa", "reference"):
            backend = BACKENDS[candidate]()
            if backend.supports(device, dtype):
                return backend
        raise ValueError(f"backend: no backend supports {dtype} on {device.type}")
    if name not in BACKENDS:
        valid = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"backend: unknown backend {name!r}; valid: {valid}")
    backend = BACKENDS[name]()
    if not backend.supports(device, dtype):
        raise ValueError(f"backend: {name!r} does not support {dtype} on {device.type}")
    return backend

