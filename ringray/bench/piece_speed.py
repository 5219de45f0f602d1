"""Each kernel on one ring block, with the ring's strides: the GPU check's speed table.

    rows = run_piece_speed(seqs=(8192, 32768), on_gpu=True)

Per head shape, tokens per rank and mask (a causal square, the diagonal block of a ring step,
or a full block, every other step), forward and backward milliseconds and TFLOP/s of every
backend that runs here, called as the ring calls it (:class:`~ringray.attention.backends.
BlockAttentionBackend`'s ``forward``/``backward`` of one piece): the queries, dO and the
output as transposed views of ``(batch, tokens, heads, head_dim)`` rows, K and V as the
contiguous halves of the ring's stacked K/V buffer, and the backward given the output and LSE
the forward returned. ``triton`` is also timed through its fused ring-step entry (what the
ring calls today, tile lists cached), as ``triton-fused``.

``auto``'s row carries the best single kernel's times (``best_forward_ms``,
``best_backward_ms``) beside its own: routing each piece to the fastest kernel must be at
least as fast as any one kernel for all pieces.

:func:`run_ring_speed` times whole ring calls the same way, on a virtual ring of 4 blocks
(:class:`~ringray.bench.virtual_ring.VirtualRing`: every rank's steps one after another,
zigzag causal and contiguous full), for the backends that run every piece kind: ``triton``
(one fused launch per block pair), ``sdpa`` and ``auto`` (a call per planned piece, merged).
That is where routing pays its own costs (a launch and a merge per piece) against the fused
kernel. On CPU the same code runs at toy sizes; its times mean nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ringray.attention.backends import FusedStepBackend, resolve_backend
from ringray.attention.pieces import PieceKind
from ringray.bench.kernel import BACKWARD_FLOP_RATIO, attention_flops, cuda_median_ms, one_block

IMPLS = ("triton", "cudnn", "flash", "flash-attn", "fa3", "sdpa", "auto")
RING_IMPLS = ("triton", "sdpa", "auto")
RING_BLOCKS = 4
GPU_HEAD_SHAPES = ((32, 8, 128), (32, 8, 64))
CPU_HEAD_SHAPES = ((4, 2, 32),)


def _median_ms(fn: Callable[[], object], warmup: int, iters: int, on_gpu: bool) -> float:
    if on_gpu:
        return cuda_median_ms(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def ring_block(heads: tuple[int, int, int], tokens: int, device: torch.device,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """One rank's block as the ring holds it: ``q``/``dout`` ``(B, H, S, D)`` views of
    ``(B, S, H, D)`` rows, ``k``/``v`` contiguous ``(B, Hkv, S, D)`` halves of one buffer."""
    q_heads, kv_heads, head_dim = heads
    g = torch.Generator(device=device).manual_seed(seed)

    def rows(h: int) -> torch.Tensor:
        return torch.randn(1, tokens, h, head_dim, generator=g, device=device,
                           dtype=torch.bfloat16)

    kv = torch.stack((rows(kv_heads).transpose(1, 2), rows(kv_heads).transpose(1, 2)))
    return {"q": rows(q_heads).transpose(1, 2), "dout": rows(q_heads).transpose(1, 2),
            "k": kv[0], "v": kv[1]}


def _timed_calls(impl: str, block: dict, kind: PieceKind, device: torch.device):
    """``(forward, backward)`` closures of ``impl`` on ``block``, or None where it cannot
    run here."""
    name = "triton" if impl == "triton-fused" else impl
    try:
        backend = resolve_backend(name, device, torch.bfloat16)
    except (ValueError, ImportError):
        return None
    q, k, v, dout = block["q"], block["k"], block["v"], block["dout"]
    scale = q.shape[-1] ** -0.5
    if impl == "triton-fused":
        return _fused_calls(backend, q, k, v, dout, kind, scale)
    out, lse = backend.forward(q, k, v, kind=kind, scale=scale)
    out_t = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # the ring's view

    def forward() -> None:
        backend.forward(q, k, v, kind=kind, scale=scale)

    def backward() -> None:
        backend.backward(dout, q, k, v, out_t, lse, kind=kind, scale=scale)

    return forward, backward


def _fused_calls(backend, q, k, v, dout, kind, scale):
    """The fused ring-step entry on one block: positions 0..S-1 on both sides, the tile
    lists cached under one key, float32 accumulators as the ring keeps them."""
    from ringray.attention.backends.common import backend_delta

    if not isinstance(backend, FusedStepBackend):
        return None
    pos, key = one_block(q.shape[2], q.device)
    causal = kind is PieceKind.CAUSAL
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)

    def forward() -> None:
        out.zero_()
        lse.fill_(float("-inf"))
        backend.forward_into(q, k, v, out, lse, causal=causal, scale=scale, q_pos=pos,
                             k_pos=pos, key=key)

    forward()
    out_t = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    f32 = {"dtype": torch.float32, "device": q.device}
    dq, dk, dv = (torch.zeros(t.shape, **f32) for t in (q, k, v))

    def backward() -> None:
        delta = backend_delta(backend, dout, out_t)
        backend.backward_into(dout, q, k, v, lse, delta, dq, dk, dv, causal=causal,
                              scale=scale, q_pos=pos, k_pos=pos, key=key)

    return forward, backward


def run_piece_speed(*, seqs: tuple[int, ...], on_gpu: bool,
                    head_shapes: tuple[tuple[int, int, int], ...] | None = None,
                    warmup: int = 2, iters: int = 5) -> list[dict]:
    """One row per (head shape, tokens, mask, kernel) that runs here; see the module doc."""
    device = torch.device("cuda" if on_gpu else "cpu")
    head_shapes = head_shapes or (GPU_HEAD_SHAPES if on_gpu else CPU_HEAD_SHAPES)
    rows = []
    for heads in head_shapes:
        for tokens in seqs:
            block = ring_block(heads, tokens, device)
            for kind in (PieceKind.CAUSAL, PieceKind.FULL):
                rows.extend(_rows_for(heads, tokens, kind, block, device, on_gpu, warmup,
                                      iters))
            del block
            if on_gpu:
                torch.cuda.empty_cache()
    return rows


def _rows_for(heads, tokens, kind, block, device, on_gpu, warmup, iters) -> list[dict]:
    q_heads, _, head_dim = heads
    flops = attention_flops(1, q_heads, tokens, head_dim, kind is PieceKind.CAUSAL)
    rows = []
    for impl in ("triton-fused", *IMPLS):
        calls = _timed_calls(impl, block, kind, device)
        if calls is None:
            continue
        rows.append({"head_shape": list(heads), "seq": tokens, "mask": kind.value,
                     "impl": impl, **_speed(calls, flops, warmup, iters, on_gpu)})
    _mark_best(rows)
    return rows


def run_ring_speed(*, seqs: tuple[int, ...], on_gpu: bool,
                   head_shapes: tuple[tuple[int, int, int], ...] | None = None,
                   warmup: int = 2, iters: int = 5) -> list[dict]:
    """One row per (head shape, tokens per rank, layout, backend): a whole ring call's
    forward and backward on a virtual ring of :data:`RING_BLOCKS` blocks; ``auto``'s row
    carries the best other backend's times, as in :func:`run_piece_speed`."""
    from ringray.attention import make_layout
    from ringray.bench.virtual_ring import VirtualRing

    device = torch.device("cuda" if on_gpu else "cpu")
    head_shapes = head_shapes or (GPU_HEAD_SHAPES if on_gpu else CPU_HEAD_SHAPES)
    rows = []
    for heads in head_shapes:
        for tokens in seqs:
            seq = RING_BLOCKS * tokens
            block = ring_block(heads, seq, device)  # the whole sequence, (B, S, H, D) below
            q, k, v, dout = (block[n].transpose(1, 2) for n in ("q", "k", "v", "dout"))
            for layout_kind, causal in (("zigzag", True), ("contiguous", False)):
                layout = make_layout(layout_kind, RING_BLOCKS, seq)
                flops = attention_flops(1, heads[0], seq, heads[2], causal)
                found = []
                for impl in RING_IMPLS:
                    try:
                        backend = resolve_backend(impl, device, torch.bfloat16)
                    except (ValueError, ImportError):
                        continue
                    ring = VirtualRing(layout, causal, backend)
                    ring.forward(q, k, v)
                    ring.backward(dout)
                    calls = (ring.forward_steps, ring.backward_steps)
                    found.append({
                        "level": "ring", "blocks": RING_BLOCKS, "head_shape": list(heads),
                        "seq": tokens, "mask": "causal" if causal else "full",
                        "layout": layout_kind, "impl": impl, "resolved": backend.name,
                        **_speed(calls, flops, warmup, iters, on_gpu)})
                _mark_best(found)
                rows.extend(found)
            if on_gpu:
                torch.cuda.empty_cache()
    return rows


def _speed(calls, flops: float, warmup: int, iters: int, on_gpu: bool) -> dict[str, float]:
    """Median milliseconds and TFLOP/s of a ``(forward, backward)`` pair of closures."""
    forward_ms = _median_ms(calls[0], warmup, iters, on_gpu)
    backward_ms = _median_ms(calls[1], warmup, iters, on_gpu)
    return {"forward_ms": round(forward_ms, 4), "backward_ms": round(backward_ms, 4),
            "forward_tflops": round(flops / forward_ms / 1e9, 1),
            "backward_tflops": round(BACKWARD_FLOP_RATIO * flops / backward_ms / 1e9, 1)}


def _mark_best(rows: list[dict]) -> None:
    """Give ``auto``'s row the best other row's times and names."""
    singles = [row for row in rows if row["impl"] != "auto"]
    for row in rows:
        if row["impl"] == "auto" and singles:
            row["best_forward_ms"] = min(r["forward_ms"] for r in singles)
            row["best_backward_ms"] = min(r["backward_ms"] for r in singles)
            row["best_forward"] = min(singles, key=lambda r: r["forward_ms"])["impl"]
            row["best_backward"] = min(singles, key=lambda r: r["backward_ms"])["impl"]
