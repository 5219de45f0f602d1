"""The compiled kernels against a float32 reference, on a virtual ring of 4 blocks.

    rows = check_ring_kernels(torch.device("cuda"), backends=("triton", "auto"))
    all(row.passed for row in rows)

What the GPU check's correctness phase runs (``benchmarks/gpu_check.py``): every backend, on
every head shape and mask below, through :class:`~ringray.bench.virtual_ring.VirtualRing`
(the tensors reach the kernels with the ring's own strides: queries as transposed views of
``(batch, local_seq, heads, head_dim)`` rows), in bfloat16, against attention computed by its
definition in float32 on the whole sequence from the same bfloat16 values
(:func:`~ringray.bench.virtual_ring.reference_attention`). Compared: the output, the LSE,
dQ, dK and dV.

Each block holds 1000 tokens on a GPU (not a multiple of any tile), so the kernels' pipelined
main loops run over real tile tables; the CPU dry run (Triton's interpreter) uses 40-token
blocks and small heads, the same masks. Documents have lengths that divide nothing,
one of them a single token.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ringray.attention import make_layout
from ringray.attention.backends import BlockAttentionBackend, resolve_backend
from ringray.attention.documents import Documents
from ringray.bench.virtual_ring import VirtualRing, reference_attention

RING_BLOCKS = 4
GPU_HEAD_SHAPES = ((32, 8, 128), (32, 8, 64), (16, 4, 80))
"""(q heads, kv heads, head_dim): Llama-3-8B's, a 64-wide GQA-4, and an unpadded 80."""
CPU_HEAD_SHAPES = ((8, 2, 32), (4, 1, 80))
GPU_BLOCK_TOKENS = 1000
CPU_BLOCK_TOKENS = 40

# name: (layout, causal, documents?, window as a fraction of the sequence, every pair?)
CASES: dict[str, tuple[str, bool, bool, float | None, bool]] = {
    "zigzag causal": ("zigzag", True, False, None, False),
    "striped causal": ("striped", True, False, None, False),
    "sliding window": ("zigzag", True, False, 0.3, False),
    "balanced documents": ("balanced", True, True, None, False),
    "whole documents": ("whole", True, True, None, False),
    "full": ("contiguous", False, False, None, False),
    "fully masked pair": ("contiguous", True, False, None, True),
}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True, kw_only=True)
class KernelCheckRow:
    backend: str
    heads: tuple[int, int, int]
    case: str
    errors: dict[str, float]
    tolerances: dict[str, float]

    @property
    def passed(self) -> bool:
        return all(self.errors[q] <= self.tolerances[q] for q in QUANTITIES)


def awkward_documents(seq: int) -> Documents:
    """Document lengths over ``seq`` tokens that divide nothing, one of them one token."""
    first = seq // 3 + 7
    lengths = [1, first, 5, seq // 4 - 3]
    lengths.append(seq - sum(lengths))
    return Documents(tuple(lengths))


def _inputs(heads: tuple[int, int, int], seq: int, device: torch.device, seed: int):
    q_heads, kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(seed)

    def randn(h: int) -> torch.Tensor:
        return torch.randn(1, seq, h, head_dim, generator=g).to(device, torch.bfloat16)

    return randn(q_heads), randn(kv_heads), randn(kv_heads), randn(q_heads)


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return (got - want.double()).abs().max().item()


def _lse_error(got: torch.Tensor, want: torch.Tensor) -> float:
    empty = torch.isneginf(want)
    if not torch.equal(torch.isneginf(got), empty):
        return float("inf")  # -inf exactly where no key is seen, and only there
    return _max_error(got[~empty], want[~empty]) if (~empty).any() else 0.0


def check_case(backend: str | BlockAttentionBackend, heads: tuple[int, int, int], case: str,
               device: torch.device, block_tokens: int) -> KernelCheckRow:
    """One backend (a name for :func:`~ringray.attention.backends.resolve_backend`, or a
    backend), head shape and mask of :data:`CASES` on the virtual ring."""
    layout_kind, causal, with_docs, window_fraction, every_pair = CASES[case]
    seq = RING_BLOCKS * block_tokens
    documents = awkward_documents(seq) if with_docs else None
    window = int(window_fraction * seq) if window_fraction else None
    layout = make_layout(layout_kind, RING_BLOCKS, seq, documents=documents)
    if isinstance(backend, str):
        backend = resolve_backend(backend, device, torch.bfloat16)
    q, k, v, dout = _inputs(heads, seq, device, seed=zlib.crc32(case.encode()))
    ring = VirtualRing(layout, causal, backend, documents=documents, window=window,
                       every_pair=every_pair)
    out, lse = ring.forward(q, k, v)
    dq, dk, dv = ring.backward(dout)
    want = reference_attention(q, k, v, dout, causal=causal, documents=documents,
                               window=window)
    errors = {"out": _max_error(out, want["out"]), "lse": _lse_error(lse, want["lse"]),
              "dq": _max_error(dq, want["dq"]), "dk": _max_error(dk, want["dk"]),
              "dv": _max_error(dv, want["dv"])}
    # bfloat16 rounds P and dS before their products (and the output once more): 2 % of the
    # tensor's largest magnitude; the LSE is accumulated in float32 from bf16 products.
    tolerances = {name: max(2e-2 * want[name].abs().max().item(), 1e-6)
                  for name in ("out", "dq", "dk", "dv")}
    tolerances["lse"] = 1e-2
    return KernelCheckRow(backend=backend.name, heads=heads, case=case, errors=errors,
                          tolerances=tolerances)


def check_ring_kernels(device: torch.device, *, backends: tuple[str, ...],
                       head_shapes: tuple[tuple[int, int, int], ...] | None = None,
                       cases: tuple[str, ...] | None = None,
                       block_tokens: int | None = None) -> list[KernelCheckRow]:
    """Every backend × head shape × case (the GPU sizes on CUDA, the small ones on CPU)."""
    on_gpu = device.type == "cuda"
    head_shapes = head_shapes or (GPU_HEAD_SHAPES if on_gpu else CPU_HEAD_SHAPES)
    block_tokens = block_tokens or (GPU_BLOCK_TOKENS if on_gpu else CPU_BLOCK_TOKENS)
    rows = []
    for backend in backends:
        for heads in head_shapes:
            for case in cases or tuple(CASES):
                rows.append(check_case(backend, heads, case, device, block_tokens))
                if on_gpu:
                    torch.cuda.empty_cache()
    return rows
