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
position-aware kernels; CUDA, and CPU under ``TRITON_INTERPRET=1`` for tests), ``routed``
(:mod:`.routed`: FULL and CAUSAL pieces to the fastest dense kernel of :mod:`.dense` -- cuDNN,
PyTorch's flash, flash-attn, FA3, Triton, SDPA -- measured once per shape class on the device;
MASKED pieces to Triton's per-piece path on CUDA, to SDPA without Triton and on CPU).

``auto``: on CUDA, ``routed`` for float16/bfloat16 where a library dense kernel runs (its
choices measured, and cached in ``~/.cache/ringray/kernel-choices.json``), else ``triton``
when the triton package is importable (its fused ring step), else ``sdpa``; on CPU ``sdpa``
(nothing to measure); float64 on CUDA falls through to ``reference``. ``auto`` on CUDA is a
measured decision, not a constant: see :mod:`.routed` for what is timed and where it is kept.
The interfaces themselves live in :mod:`.protocols`.

A backend may also offer the optional :class:`FusedStepBackend` capability (``triton``
does): whole ring-step blocks addressed by global positions, accumulated in place. The ring
checks for it with ``isinstance`` and otherwise calls ``forward``/``backward`` per planned
piece and merges with :func:`~ringray.attention.merge.merge_into`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from ringray.attention.backends.common import BlockPairKey, triton_importable
from ringray.attention.backends.protocols import (
    BlockAttentionBackend,
    DenseKernel,
    FusedStepBackend,
)
from ringray.attention.backends.reference import ReferenceBackend
from ringray.attention.backends.routed import auto_routed_backend, routed_backend
from ringray.attention.backends.sdpa import SdpaBackend

__all__ = [
    "BACKENDS", "BlockAttentionBackend", "BlockPairKey", "DenseKernel", "FusedStepBackend",
    "auto_candidates", "resolve_backend", "triton_importable",
]


def _triton_backend() -> BlockAttentionBackend:
    from ringray.attention.backends.triton import TritonBackend  # needs the triton package

    return TritonBackend()


BACKENDS: Mapping[str, Callable[[], BlockAttentionBackend]] = MappingProxyType(
    {"reference": ReferenceBackend, "sdpa": SdpaBackend, "triton": _triton_backend,
     "routed": routed_backend}
)


def auto_candidates(device: torch.device) -> tuple[str, ...]:
    """Backends ``auto`` tries in order. On CUDA: ``routed`` where a library kernel runs the
    dtype (:func:`~.routed.auto_routed_backend`), then ``triton`` when it is installed, then
    ``sdpa`` and ``reference``. Elsewhere ``sdpa``, then ``reference``."""
    if device.type == "cuda":
        tail = ("triton", "sdpa", "reference") if triton_importable() else ("sdpa", "reference")
        return ("routed", *tail)
    return ("sdpa", "reference")


def resolve_backend(name: str | BlockAttentionBackend, device: torch.device,
                    dtype: torch.dtype) -> BlockAttentionBackend:
    """The backend called ``name`` (or the best one for ``auto``), checked for support.

    A backend object is checked and returned as it is: a caller that makes many ring calls
    (a training step's layers) may resolve ``auto`` once and pass the object, so that a
    routed backend's measured choices stay with it."""
    if not isinstance(name, str):
        if not name.supports(device, dtype):
            raise ValueError(f"backend: {name.name!r} does not support {dtype} on "
                             f"{device.type}")
        return name
    if name == "auto":
        for candidate in auto_candidates(device):
            backend = (auto_routed_backend(device, dtype) if candidate == "routed"
                       else BACKENDS[candidate]())
            if backend is not None and backend.supports(device, dtype):
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
