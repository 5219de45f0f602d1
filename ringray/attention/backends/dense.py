"""Dense kernels for the unmasked pieces (``FULL`` and ``CAUSAL``), each returning the LSE.

Each is a :class:`~.protocols.DenseKernel`: its forward gives ``(out, lse)`` with the LSE in
natural log, float32, ``(B, H, S)``; its backward takes the ring's *final* out and LSE of its
rows (the flash-attention backward identity), so that its gradients are exact partial sums.
:class:`~.routed.RoutedBackend` sends the ring's FULL and CAUSAL pieces to the fastest of
them, measured on the device.

- ``cudnn``: cuDNN's fused attention through PyTorch
  (``aten._scaled_dot_product_cudnn_attention`` and its backward). Its LSE (cuDNN's "softmax
  stats", natural log, float32) comes back ``(B, H, S, 1)`` from recent torch and ``(B, H,
  S)`` from older releases; both are read as ``(B, H, S)``, and the backward is given the
  ``(B, H, S, 1)`` shape cuDNN's graph documents.
- ``flash``: PyTorch's own flash kernel, the calls :mod:`.sdpa` makes on CUDA.
- ``flash-attn``: the flash-attn package (FlashAttention-2, ``pip install ringray[flash]``):
  the public ``flash_attn_func(..., return_attn_probs=True)`` for the forward and
  ``_flash_attn_backward`` for the backward, called by keyword after reading its signature,
  which flash-attn releases have changed (``window_size`` became ``window_size_left`` and
  ``_right``, ``softcap`` appeared, the function became a torch custom op).
- ``fa3``: FlashAttention-3's ``flash_attn_interface`` (the ``hopper/`` build), the same way.

All four need CUDA and float16/bfloat16 inputs, a head dimension that is a multiple of 8 (at
most 128 for cuDNN, 256 for the others) and an sm80+ GPU; a library that is not built into
torch or not installed reports ``supports() == False`` and is never tried. None of them runs
without a GPU: their tests are marked ``gpu``.

Grouped-query attention: flash-attn and FA3 take K/V at their own head count (and return
dK/dV there); the PyTorch kernels get K/V heads repeated and their gradients summed back, as
:mod:`.sdpa` does (the copy is linear in the block, the kernel quadratic).
:class:`WholeBackendKernel` offers a whole backend (``sdpa``, ``triton``, ``reference``) as
one more candidate, so that the measurement can also keep it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Collection
from types import ModuleType

import torch

from ringray.attention.backends.common import expand_kv_heads, reduce_kv_heads
from ringray.attention.backends.protocols import BlockAttentionBackend
from ringray.attention.backends.sdpa import flash_backward, flash_forward
from ringray.attention.pieces import PieceKind

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_MIN_CUDNN_VERSION = 90000  # cuDNN 9: the fused attention backward PyTorch builds on


def _gpu_generation(device: torch.device) -> int | None:
    """The compute capability's major number of ``device``, or None where it cannot run."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0]


def _half_on_ampere(device: torch.device, dtype: torch.dtype) -> bool:
    generation = _gpu_generation(device)
    return dtype in _HALF and generation is not None and generation >= 8


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def _check_kind(kind: PieceKind, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the piece is CAUSAL (else FULL); a MASKED piece or a causal rectangle is a
    caller's error (the routed backend sends those to the masked backend)."""
    if kind is PieceKind.MASKED or (kind is PieceKind.CAUSAL and q.shape[2] != k.shape[2]):
        raise ValueError(f"a dense kernel takes FULL pieces and CAUSAL squares, got {kind} "
                         f"of {q.shape[2]} x {k.shape[2]}")
    return kind is PieceKind.CAUSAL


class CudnnKernel:
    """cuDNN's fused attention through PyTorch's ops (see the module docstring)."""

    name = "cudnn"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return (version is not None and version >= _MIN_CUDNN_VERSION
                and hasattr(_aten, "_scaled_dot_product_cudnn_attention_backward")
                and _half_on_ampere(device, dtype))

    def supports_head_dim(self, head_dim: int) -> bool:
        return head_dim % 8 == 0 and head_dim <= 128

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        causal = _check_kind(kind, q, k)
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        result = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        out, stats = result[0], result[1]
        return out, stats[..., 0] if stats.dim() == 4 else stats

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        causal = _check_kind(kind, q, k)
        kv_heads = k.shape[1]
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)
        stats = lse.float().contiguous().unsqueeze(-1)  # (B, H, S, 1), as cuDNN lays it out
        # None passes an undefined tensor (no bias, no variable-length batch), as autograd
        # does; max_q/max_k are the dense lengths.
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), stats, no_rng, no_rng, None, None,
            None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        return dq, reduce_kv_heads(dk, kv_heads), reduce_kv_heads(dv, kv_heads)


class TorchFlashKernel:
    """PyTorch's flash kernel (FlashAttention-2 built into torch), the calls of :mod:`.sdpa`."""

    name = "flash"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
        return built and _half_on_ampere(device, dtype)

    def supports_head_dim(self, head_dim: int) -> bool:
        return head_dim % 8 == 0 and head_dim <= 256

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        causal = _check_kind(kind, q, k)
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        return flash_forward(q, k, v, causal=causal, scale=scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        causal = _check_kind(kind, q, k)
        kv_heads = k.shape[1]
        k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
        dq, dk, dv = flash_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        return dq, reduce_kv_heads(dk, kv_heads), reduce_kv_heads(dv, kv_heads)


def _parameters_known(fn: Callable, known: Collection[str]) -> tuple[str, ...]:
    """The parameters of ``fn`` (a torch custom op is read through the function it wraps)
    that are in ``known``, to pass by keyword; the others keep their defaults. A parameter
    without a default that ``known`` lacks is a ``TypeError`` naming it: a release this
    adapter does not know."""
    parameters = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    for name, parameter in parameters.items():
        if name not in known and parameter.default is inspect.Parameter.empty:
            raise TypeError(f"{getattr(fn, '__name__', fn)}: parameter {name!r} is not one "
                            f"this adapter knows; this release is not supported")
    return tuple(name for name in parameters if name in known)


# What a flash-attn or FA3 backward parameter is set to when the signature has it (beside
# the tensors, the scale and the causal flag): no dropout, no window, no softcap.
_BACKWARD_DEFAULTS: dict[str, object] = {
    "dropout_p": 0.0, "window_size": (-1, -1), "window_size_left": -1,
    "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None, "deterministic": False,
    "rng_state": None, "sm_margin": 0,
}
_BACKWARD_PARAMETERS = frozenset({
    *_BACKWARD_DEFAULTS, "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv",
    "softmax_scale", "causal", "is_causal",
})
"""Every backward parameter the adapter sets (FA2 names the flag ``causal``, FA3
``is_causal``)."""


class _FlashAttnPackage:
    """A FlashAttention package's kernel (``(B, S, H, D)`` layout, GQA native), reached
    through its interface module: ``flash_attn_func`` for the forward, ``_flash_attn_backward``
    for the backward."""

    name = ""
    modules: tuple[str, ...] = ()  # the interface module's names, tried in order
    min_generation = 8

    def __init__(self) -> None:
        self._interface: ModuleType | None = None
        self._forward_returns_lse: bool | None = None  # flash_attn_func has return_attn_probs
        self._backward_parameters: tuple[str, ...] | None = None  # read once per instance

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        generation = _gpu_generation(device)
        return (dtype in _HALF and generation is not None
                and generation >= self.min_generation
                and any(_module_present(m) for m in self.modules))

    def supports_head_dim(self, head_dim: int) -> bool:
        return head_dim % 8 == 0 and head_dim <= 256

    def interface(self) -> ModuleType:
        if self._interface is None:
            present = [m for m in self.modules if _module_present(m)]
            if not present:
                raise ImportError(f"{self.name}: none of {', '.join(self.modules)} is installed")
            self._interface = importlib.import_module(present[0])
        return self._interface

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        causal = _check_kind(kind, q, k)
        func = self.interface().flash_attn_func
        if self._forward_returns_lse is None:  # FA3's first releases returned the LSE always
            self._forward_returns_lse = "return_attn_probs" in inspect.signature(func).parameters
        args = {"softmax_scale": scale, "causal": causal}
        if self._forward_returns_lse:
            args["return_attn_probs"] = True
        with torch.no_grad():
            result = func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **args)
        if not isinstance(result, tuple):
            raise TypeError(f"{self.name}: flash_attn_func returned no LSE")
        out, lse = result[0], result[1]
        return out.transpose(1, 2), lse[..., : q.shape[2]]

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        causal = _check_kind(kind, q, k)
        q_, k_, v_ = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # The package writes the gradients into these (its own return value is only dsoftmax).
        dq = torch.empty(q_.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k_.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v_.shape, dtype=v.dtype, device=v.device)
        backward = self.interface()._flash_attn_backward
        values = {
            **_BACKWARD_DEFAULTS, "dout": dout.to(q.dtype).transpose(1, 2), "q": q_, "k": k_,
            "v": v_, "out": out.to(q.dtype).transpose(1, 2),
            "softmax_lse": lse.float().contiguous(), "dq": dq, "dk": dk, "dv": dv,
            "softmax_scale": scale, "causal": causal, "is_causal": causal,
        }
        if self._backward_parameters is None:
            self._backward_parameters = _parameters_known(backward, _BACKWARD_PARAMETERS)
        backward(**{name: values[name] for name in self._backward_parameters})
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class FlashAttnKernel(_FlashAttnPackage):
    """FlashAttention-2, the flash-attn package."""

    name = "flash-attn"
    modules = ("flash_attn.flash_attn_interface",)


class FlashAttn3Kernel(_FlashAttnPackage):
    """FlashAttention-3 (the ``hopper/`` build of flash-attention), for Hopper GPUs."""

    name = "fa3"
    modules = ("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    min_generation = 9


def library_kernels() -> tuple[CudnnKernel, TorchFlashKernel, FlashAttnKernel,
                               FlashAttn3Kernel]:
    """One of each library kernel (each tells by ``supports`` whether it runs here)."""
    return (CudnnKernel(), TorchFlashKernel(), FlashAttnKernel(), FlashAttn3Kernel())


class WholeBackendKernel:
    """A whole backend (``sdpa``, ``triton``, ``reference``) offered as a dense kernel: it
    takes every head dimension its ``supports`` allows."""

    def __init__(self, backend: BlockAttentionBackend) -> None:
        self.backend = backend
        self.name = backend.name

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return self.backend.supports(device, dtype)

    def supports_head_dim(self, head_dim: int) -> bool:
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.forward(q, k, v, kind=kind, scale=scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.backend.backward(dout, q, k, v, out, lse, kind=kind, scale=scale)
