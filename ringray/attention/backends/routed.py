"""The ``routed`` backend: each planned piece to the fastest kernel for it, measured.

    backend = resolve_backend("auto", torch.device("cuda"), torch.bfloat16)  # a RoutedBackend
    out = ring_attention(q, k, v, group, backend=backend)  # one instance: its choices stay

FULL pieces and CAUSAL squares go to a dense kernel (:mod:`.dense`): cuDNN, PyTorch's flash,
flash-attn and FA3 where they run, and Triton's and SDPA's per-piece paths as candidates too,
so that the measurement can also keep one of those. MASKED pieces (document
boundaries, a window's edge, irregular layouts) go to the masked backend: Triton's per-piece
path on CUDA when Triton is installed, else SDPA. It offers the plain
:class:`~.protocols.BlockAttentionBackend` interface, not the fused ring step, so the ring
calls it once per planned piece and merges by LSE.

How a dense kernel is chosen (:class:`KernelChoices`): pieces fall into *shape classes*
(:class:`ShapeClass`: the device's name, dtype, head dim, query heads per K/V head, piece
kind, and the piece's longer side rounded up to a power of two). The first piece of a class
times each candidate that runs there (its ``supports`` and ``supports_head_dim``): forward
then backward on random inputs of that piece's shapes, one warm-up and the best of three
(CUDA events on CUDA, two synchronisations per class; ``perf_counter`` on CPU), and keeps the
fastest; a candidate that raises is dropped (:attr:`KernelChoices.failures` says why). Every
later piece of the class reuses the choice without measuring. A single candidate is never
measured: on CPU the only dense candidate is SDPA, so nothing is timed there.

Where choices live: in the :class:`KernelChoices` that the backend instance owns (no
module-level state), and, when it has a ``path`` (``auto`` and ``"routed"`` by name use
:func:`default_choices_path`, ``~/.cache/ringray/kernel-choices.json``), in a JSON file keyed
by torch's version and the candidates' names, each class keyed with the device's name. A
restarted job, another rank on the machine, or a new instance reads a choice there instead of
measuring it again. The file is only a cache: a missing, unreadable or unwritable file means
measuring, and a stored choice that is not a candidate now is measured again. Note that
``ring_attention(..., backend="auto")`` resolves a new backend per call, whose in-memory
choices start empty: it then reads the file once per call and measures only what the file
lacks; a caller that gives the ring one resolved instance keeps the choices in memory, as
the trainer and the evaluation harness do.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ringray.attention.backends.common import triton_importable
from ringray.attention.backends.dense import WholeBackendKernel, library_kernels
from ringray.attention.backends.protocols import BlockAttentionBackend, DenseKernel
from ringray.attention.backends.sdpa import SdpaBackend
from ringray.attention.pieces import PieceKind

_STORE_FORMAT = 1


def default_choices_path() -> Path:
    """Where ``auto`` keeps measured choices: ``~/.cache/ringray/kernel-choices.json``."""
    return Path.home() / ".cache" / "ringray" / "kernel-choices.json"


@dataclass(frozen=True)
class ShapeClass:
    """Pieces that one measurement stands for."""

    device: str  # the device's name ("NVIDIA H200", or "cpu")
    dtype: str
    head_dim: int
    group: int  # query heads per K/V head
    kind: str  # "full" or "causal"
    length: int  # the piece's longer side, rounded up to a power of two

    @classmethod
    def of(cls, device_name: str, q: torch.Tensor, k: torch.Tensor,
           kind: PieceKind) -> ShapeClass:
        longer = max(q.shape[2], k.shape[2])
        return cls(device=device_name, dtype=str(q.dtype).removeprefix("torch."),
                   head_dim=q.shape[3], group=q.shape[1] // k.shape[1], kind=kind.value,
                   length=1 << (longer - 1).bit_length())

    def key(self) -> str:
        """The class as text, for the JSON file."""
        return (f"{self.device}|{self.dtype}|d{self.head_dim}|g{self.group}|{self.kind}|"
                f"{self.length}")


class KernelChoices:
    """The fastest dense kernel per shape class, measured once per class (see the module
    docstring). ``path``: a JSON file that keeps the choices across processes (None: this
    object only). ``repeats``/``warmup``: timed and untimed forward+backward runs of each
    candidate."""

    def __init__(self, *, path: Path | None = None, repeats: int = 3, warmup: int = 1) -> None:
        self.path = path
        self.repeats, self.warmup = repeats, warmup
        self.measured = 0
        """Shape classes this object has timed its candidates for."""
        self.seconds: dict[ShapeClass, dict[str, float]] = {}
        """Per class measured, each candidate's best forward+backward time."""
        self.failures: dict[str, str] = {}
        """Candidates that raised when timed (dropped from that class): name -> error."""
        self._chosen: dict[tuple[ShapeClass, tuple[str, ...]], str | None] = {}
        self._stored: dict[str, dict[str, str]] | None = None  # the file's, read once
        self._device_names: dict[torch.device, str] = {}

    def choose(self, candidates: Sequence[DenseKernel], q: torch.Tensor, k: torch.Tensor,
               kind: PieceKind, scale: float) -> DenseKernel | None:
        """The kernel for this piece's class among ``candidates`` (measured on its first
        piece), or None when none of them runs it."""
        names = tuple(kernel.name for kernel in candidates)
        key = (ShapeClass.of(self._device_name(q.device), q, k, kind), names)
        if key not in self._chosen:
            self._chosen[key] = self._decide(candidates, key[0], q, k, kind, scale)
        name = self._chosen[key]
        return None if name is None else candidates[names.index(name)]

    def chosen(self) -> dict[ShapeClass, str | None]:
        """What each class met so far resolved to (None: no dense kernel)."""
        return {shape: name for (shape, _), name in self._chosen.items()}

    def _device_name(self, device: torch.device) -> str:
        if device not in self._device_names:
            self._device_names[device] = (torch.cuda.get_device_name(device)
                                          if device.type == "cuda" else device.type)
        return self._device_names[device]

    def _decide(self, candidates: Sequence[DenseKernel], shape: ShapeClass, q: torch.Tensor,
                k: torch.Tensor, kind: PieceKind, scale: float) -> str | None:
        fitting = [kernel for kernel in candidates
                   if kernel.supports(q.device, q.dtype) and kernel.supports_head_dim(q.shape[3])]
        if len(fitting) <= 1:
            return fitting[0].name if fitting else None
        store_key = _store_key(fitting)
        stored = self._read().get(store_key, {}).get(shape.key())
        if stored in {kernel.name for kernel in fitting}:
            return stored
        seconds = {}
        for kernel in fitting:
            try:
                seconds[kernel.name] = _time_piece(kernel, q, k, kind, scale, self.repeats,
                                                   self.warmup)
            except Exception as error:  # noqa: BLE001 - a kernel that cannot run is not chosen
                self.failures[kernel.name] = f"{type(error).__name__}: {error}"
        self.measured += 1
        self.seconds[shape] = seconds
        if not seconds:
            return None
        fastest = min(seconds, key=seconds.__getitem__)
        self._write(store_key, shape.key(), fastest)
        return fastest

    def _read(self) -> dict[str, dict[str, str]]:
        if self._stored is None:
            self._stored = _load_store(self.path) if self.path is not None else {}
        return self._stored

    def _write(self, store_key: str, class_key: str, name: str) -> None:
        self._read().setdefault(store_key, {})[class_key] = name
        if self.path is None:
            return
        merged = _load_store(self.path)  # what other processes wrote meanwhile
        merged.setdefault(store_key, {})[class_key] = name
        text = json.dumps({"format": _STORE_FORMAT, "choices": merged}, indent=1,
                          sort_keys=True)
        try:  # a whole file or none: written aside, then renamed over the old one
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            scratch.write_text(text)
            os.replace(scratch, self.path)
        except OSError:
            pass  # a cache that cannot be written only means measuring again later


def _store_key(kernels: Sequence[DenseKernel]) -> str:
    return f"torch {torch.__version__}; " + " ".join(sorted(kernel.name for kernel in kernels))


def _load_store(path: Path) -> dict[str, dict[str, str]]:
    """The file's choices; {} when it is missing, unreadable or not this format."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _STORE_FORMAT:
        return {}
    choices = data.get("choices")
    if not isinstance(choices, dict):
        return {}
    return {key: classes for key, classes in choices.items() if isinstance(classes, dict)}


def _time_piece(kernel: DenseKernel, q: torch.Tensor, k: torch.Tensor, kind: PieceKind,
                scale: float, repeats: int, warmup: int) -> float:
    """Best seconds of ``kernel``'s forward then backward on random inputs shaped (and laid
    out) like this piece's."""
    q_in, k_in, v_in, dout = (torch.randn_like(t) for t in (q, k, k, q))

    def step() -> None:
        out, lse = kernel.forward(q_in, k_in, v_in, kind=kind, scale=scale)
        kernel.backward(dout, q_in, k_in, v_in, out, lse, kind=kind, scale=scale)

    with torch.no_grad():
        for _ in range(warmup):  # compiles, builds cuDNN's graph, fills caches: not timed
            step()
        if q.device.type != "cuda":
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            return min(times)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        # Start on an idle stream, so that the first timed run also counts its launches.
        torch.cuda.current_stream(q.device).synchronize()
        for start, end in events:
            start.record()
            step()
            end.record()
        events[-1][1].synchronize()
        return min(start.elapsed_time(end) for start, end in events) / 1000


class RoutedBackend:
    """FULL and CAUSAL pieces to the measured fastest dense kernel, MASKED pieces to the
    masked backend (see the module docstring). ``dense``: the candidates (default: per
    device, the library kernels, Triton and SDPA on CUDA; SDPA on CPU). ``masked``: the
    backend for masked pieces, and for any piece no candidate runs (default: Triton on CUDA
    when installed, else SDPA). ``choices``: where measured choices are kept (default: in
    this object only)."""

    name = "routed"

    def __init__(self, dense: Sequence[DenseKernel] | None = None,
                 masked: BlockAttentionBackend | None = None, *,
                 choices: KernelChoices | None = None) -> None:
        self.choices = choices if choices is not None else KernelChoices()
        self._dense = tuple(dense) if dense is not None else None
        self._masked = masked
        self._default_dense: dict[str, tuple[DenseKernel, ...]] = {}
        self._default_masked: dict[tuple[str, torch.dtype], BlockAttentionBackend | None] = {}

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return self.masked_backend(device, dtype) is not None

    def dense_kernels(self, device: torch.device) -> tuple[DenseKernel, ...]:
        """The dense candidates on ``device``."""
        if self._dense is not None:
            return self._dense
        if device.type not in self._default_dense:
            self._default_dense[device.type] = _default_dense(device)
        return self._default_dense[device.type]

    def masked_backend(self, device: torch.device,
                       dtype: torch.dtype) -> BlockAttentionBackend | None:
        """The backend for masked pieces on ``device`` and ``dtype`` (None: none runs)."""
        if self._masked is not None:
            return self._masked if self._masked.supports(device, dtype) else None
        key = (device.type, dtype)
        if key not in self._default_masked:
            self._default_masked[key] = _default_masked(device, dtype)
        return self._default_masked[key]

    def dense_for(self, q: torch.Tensor, k: torch.Tensor, kind: PieceKind,
                  scale: float) -> DenseKernel | None:
        """The dense kernel this piece goes to (None: the masked backend)."""
        if kind is PieceKind.MASKED or (kind is PieceKind.CAUSAL and q.shape[2] != k.shape[2]):
            return None
        return self.choices.choose(self.dense_kernels(q.device), q, k, kind, scale)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: PieceKind,
        scale: float, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
        causal: bool = True, q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None, window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = self.dense_for(q, k, kind, scale)
        if kernel is not None:
            return kernel.forward(q, k, v, kind=kind, scale=scale)
        return self._masked_for(q).forward(
            q, k, v, kind=kind, scale=scale, q_pos=q_pos, k_pos=k_pos, causal=causal,
            q_doc=q_doc, k_doc=k_doc, window=window,
        )

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, *, kind: PieceKind, scale: float,
        q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
        causal: bool = True, q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None, window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kernel = self.dense_for(q, k, kind, scale)
        if kernel is not None:
            return kernel.backward(dout, q, k, v, out, lse, kind=kind, scale=scale)
        return self._masked_for(q).backward(
            dout, q, k, v, out, lse, kind=kind, scale=scale, q_pos=q_pos, k_pos=k_pos,
            causal=causal, q_doc=q_doc, k_doc=k_doc, window=window,
        )

    def _masked_for(self, q: torch.Tensor) -> BlockAttentionBackend:
        backend = self.masked_backend(q.device, q.dtype)
        if backend is None:
            raise ValueError(f"backend: 'routed' has no masked backend for {q.dtype} on "
                             f"{q.device.type}")
        return backend


def _triton() -> BlockAttentionBackend:
    from ringray.attention.backends.triton import TritonBackend  # needs the triton package

    return TritonBackend()


def _default_dense(device: torch.device) -> tuple[DenseKernel, ...]:
    """CUDA: the library kernels, Triton's and SDPA's per-piece paths. Elsewhere SDPA alone
    (Triton runs on CPU only in its interpreter, for tests)."""
    sdpa = WholeBackendKernel(SdpaBackend())
    if device.type != "cuda":
        return (sdpa,)
    triton = (WholeBackendKernel(_triton()),) if triton_importable() else ()
    return (*library_kernels(), *triton, sdpa)


def _default_masked(device: torch.device, dtype: torch.dtype) -> BlockAttentionBackend | None:
    options = [_triton()] if device.type == "cuda" and triton_importable() else []
    options.append(SdpaBackend())
    return next((backend for backend in options if backend.supports(device, dtype)), None)


def routed_backend() -> RoutedBackend:
    """``"routed"`` by name: the default candidates, choices kept in
    :func:`default_choices_path` as well."""
    return RoutedBackend(choices=KernelChoices(path=default_choices_path()))


def auto_routed_backend(device: torch.device, dtype: torch.dtype) -> RoutedBackend | None:
    """What ``auto`` takes on CUDA: a routed backend where a library kernel runs this dtype
    (float16/bfloat16 on an sm80+ GPU with cuDNN, PyTorch's flash, flash-attn or FA3), else
    None (float32: the fused Triton step, which a per-piece route could only slow)."""
    if not any(kernel.supports(device, dtype) for kernel in library_kernels()):
        return None
    backend = routed_backend()
    return backend if backend.supports(device, dtype) else None
