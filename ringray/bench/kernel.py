"""``ringray bench kernel``: the Triton ring-step kernels against PyTorch SDPA, on one GPU.

On CUDA, per sequence length and mask (causal, full), in the configured dtype:

- forward and backward milliseconds and TFLOP/s of ``triton`` (the project's kernels), of
  ``scaled_dot_product_attention`` restricted to the flash backend, and of SDPA's cuDNN
  backend where this PyTorch build and GPU have it. FLOPs: ``4 · B · Hq · S² · D`` for the
  forward (two matrix products), 2.5 times that for the backward (five), halved for causal.
  SDPA gets K/V with their heads already repeated to the query-head count (outside the
  timed region): its flash kernel is then doing exactly the FLOPs counted.
  The triton backward includes computing ``delta = rowsum(dO · O)``. Inputs have the
  ring's strides: q and dO are transposed views of ``(B, S, H, D)`` rows, K and V
  contiguous ``(B, Hkv, S, D)``, as the ring hands them to a kernel.
- a single-GPU "virtual ring" (:class:`~ringray.bench.virtual_ring.VirtualRing`): the same
  sequence cut by a layout (zigzag when causal, contiguous when full) into N blocks and
  processed step by step the way :func:`~ringray.attention.ring_attention` does on N ranks
  (every rank's queries against every K/V block, empty block pairs skipped by the plan, the
  merge fused into the forward kernel, the backward adding into float32 accumulators with
  delta computed once per rank), against one SDPA flash call on the whole sequence: the
  ratio of times is the cost of cutting the sequence up, communication left aside.

Times come from CUDA events around each repetition, read after the last one; the median of
``iters`` repetitions after ``warmup`` is reported.

On CPU there is nothing to time (the kernels run in Triton's interpreter); ``run_smoke``
checks the kernels, in tiny shapes, against the float64 ``reference`` backend instead, and
also runs on CUDA (the compiled kernels) as the start of every GPU benchmark.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.table import Table

from ringray.attention import make_layout
from ringray.attention.backends.common import expand_kv_heads, softmax_delta
from ringray.attention.backends.reference import ReferenceBackend
from ringray.attention.pieces import PieceKind

# Backward FLOPs as a multiple of the forward's: five matrix products against two.
BACKWARD_FLOP_RATIO = 2.5


@dataclass(frozen=True)
class KernelBenchConfig:
    seqs: tuple[int, ...] = (4096, 8192, 16384)
    batch: int = 1
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    masks: tuple[bool, ...] = (True, False)  # causal?
    ring_blocks: int = 4  # N of the virtual ring
    warmup: int = 3
    iters: int = 10


@dataclass(frozen=True)
class SpeedRow:
    seq: int
    causal: bool
    impl: str  # triton | sdpa-flash | sdpa-cudnn
    forward_ms: float
    backward_ms: float
    forward_tflops: float
    backward_tflops: float


@dataclass(frozen=True)
class VirtualRingRow:
    seq: int
    causal: bool
    blocks: int
    layout: str
    forward_ms: float
    backward_ms: float
    sdpa_forward_ms: float
    sdpa_backward_ms: float
    forward_ratio: float  # virtual ring time / one SDPA call; 1.0 = no overhead
    backward_ratio: float


@dataclass(frozen=True)
class SmokeRow:
    case: str
    max_errors: dict[str, float]  # out, lse, dq, dk, dv: largest absolute error
    tolerances: dict[str, float]
    passed: bool


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of attention over ``seq`` tokens (causal counted as half)."""
    flops = 4.0 * batch * heads * seq * seq * head_dim
    return flops / 2 if causal else flops


def cuda_median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` on the current stream, from CUDA events read once."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _inputs(cfg: KernelBenchConfig, seq: int, device: torch.device, seed: int = 0):
    """q, dout ``(B, Hq, S, D)`` and k, v ``(B, Hkv, S, D)`` in the benchmark dtype, with the
    ring's strides: q and dout are transposed views of ``(B, S, H, D)`` rows (as the ring
    hands them to a kernel), k and v contiguous (the halves of the ring's K/V buffer)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)

    def rows(heads: int) -> torch.Tensor:
        return torch.randn(cfg.batch, seq, heads, cfg.head_dim, generator=g, device=device,
                           dtype=dtype).transpose(1, 2)

    return (rows(cfg.heads), rows(cfg.kv_heads).contiguous(), rows(cfg.kv_heads).contiguous(),
            rows(cfg.heads))


def one_block(seq: int, device: torch.device):
    """Positions of one whole sequence and the tile-list key that names them (a one-rank
    contiguous layout), so that timed calls reuse cached tile lists as ring steps do."""
    from ringray.attention.backends.common import BlockPairKey

    pos = torch.arange(seq, device=device, dtype=torch.int32)
    return pos, BlockPairKey(make_layout("contiguous", 1, seq), 0, 0)


def _time_triton(cfg, q, k, v, dout, causal) -> tuple[float, float]:
    from ringray.attention.backends.triton_backward import block_backward, softmax_delta_triton
    from ringray.attention.backends.triton_forward import block_forward

    scale = cfg.head_dim**-0.5
    pos, key = one_block(q.shape[2], q.device)
    forward_ms = cuda_median_ms(
        lambda: block_forward(q, k, v, pos, pos, causal=causal, scale=scale, key=key),
        cfg.warmup, cfg.iters)
    out, lse = block_forward(q, k, v, pos, pos, causal=causal, scale=scale, key=key)
    out = out.to(q.dtype)

    def backward() -> None:
        delta = softmax_delta_triton(dout, out)  # the ring's delta for a triton backend
        block_backward(dout, q, k, v, lse, delta, pos, pos, causal=causal, scale=scale,
                       key=key)

    return forward_ms, cuda_median_ms(backward, cfg.warmup, cfg.iters)


def _time_sdpa(cfg, q, k, v, dout, causal, backend) -> tuple[float, float] | None:
    """Forward and backward ms of SDPA pinned to ``backend``; None if it cannot run."""
    from torch.nn.attention import sdpa_kernel

    k_full, v_full = expand_kv_heads(k, cfg.heads), expand_kv_heads(v, cfg.heads)
    leaves = [t.detach().requires_grad_() for t in (q, k_full, v_full)]
    try:
        with sdpa_kernel(backend):
            forward_ms = cuda_median_ms(
                lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal),
                cfg.warmup, cfg.iters)
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            backward_ms = cuda_median_ms(
                lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                cfg.warmup, cfg.iters)
    except RuntimeError:  # this backend is not available for these inputs or this GPU
        return None
    return forward_ms, backward_ms


def _speed_row(cfg, seq, causal, impl, times) -> SpeedRow:
    flops = attention_flops(cfg.batch, cfg.heads, seq, cfg.head_dim, causal)
    forward_ms, backward_ms = times
    return SpeedRow(seq, causal, impl, forward_ms, backward_ms, flops / forward_ms / 1e9,
                    BACKWARD_FLOP_RATIO * flops / backward_ms / 1e9)


def run_speed(cfg: KernelBenchConfig) -> list[SpeedRow]:
    """Forward/backward speed of triton vs SDPA flash (and cuDNN) per seq and mask."""
    from torch.nn.attention import SDPBackend

    device = torch.device("cuda")
    rows = []
    for seq in cfg.seqs:
        q, k, v, dout = _inputs(cfg, seq, device)
        for causal in cfg.masks:
            rows.append(_speed_row(cfg, seq, causal, "triton",
                                   _time_triton(cfg, q, k, v, dout, causal)))
            for impl, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                  ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                times = _time_sdpa(cfg, q, k, v, dout, causal, backend)
                if times is not None:
                    rows.append(_speed_row(cfg, seq, causal, impl, times))
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


def run_virtual_ring(cfg: KernelBenchConfig) -> list[VirtualRingRow]:
    """The virtual ring (:class:`~ringray.bench.virtual_ring.VirtualRing`, the ring's
    strides) against one SDPA flash call, per seq and mask."""
    from torch.nn.attention import SDPBackend

    from ringray.attention.backends.triton import TritonBackend
    from ringray.bench.virtual_ring import VirtualRing

    rows = []
    for seq in cfg.seqs:
        q, k, v, dout = _inputs(cfg, seq, torch.device("cuda"))
        for causal in cfg.masks:
            layout = "zigzag" if causal else "contiguous"
            ring = VirtualRing(make_layout(layout, cfg.ring_blocks, seq), causal,
                               TritonBackend(), scale=cfg.head_dim**-0.5)
            ring.forward(*(t.transpose(1, 2) for t in (q, k, v)))  # lays out the blocks
            ring.backward(dout.transpose(1, 2))
            forward_ms = cuda_median_ms(ring.forward_steps, cfg.warmup, cfg.iters)
            backward_ms = cuda_median_ms(ring.backward_steps, cfg.warmup, cfg.iters)
            sdpa = _time_sdpa(cfg, q, k, v, dout, causal, SDPBackend.FLASH_ATTENTION)
            if sdpa is None:
                raise RuntimeError("SDPA's flash backend cannot run these inputs on this GPU")
            rows.append(VirtualRingRow(seq, causal, cfg.ring_blocks, layout, forward_ms,
                                       backward_ms, sdpa[0], sdpa[1], forward_ms / sdpa[0],
                                       backward_ms / sdpa[1]))
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- correctness smoke

SMOKE_QUANTITIES = ("out", "lse", "dq", "dk", "dv")
SMOKE_PATTERNS = {  # name: (layout, query rank, key rank) over 2 ranks
    "zigzag 1<-0": ("zigzag", 1, 0),
    "striped 0<-1": ("striped", 0, 1),
    "contiguous 1<-1": ("contiguous", 1, 1),
    "contiguous 0<-1": ("contiguous", 0, 1),  # every row sees no key
}


def _smoke_case(device, dtype, pattern, causal) -> SmokeRow:
    from ringray.attention.backends.triton_backward import block_backward
    from ringray.attention.backends.triton_forward import block_forward

    kind, q_rank, k_rank = SMOKE_PATTERNS[pattern]
    layout = make_layout(kind, 2, 80)  # 40 tokens a block: not a multiple of the tile
    q_pos, k_pos = layout.positions(q_rank), layout.positions(k_rank)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, 40, 80, generator=g).to(device=device, dtype=dtype)
                     for heads in (4, 2, 2, 4))
    scale = 80**-0.5
    piece = PieceKind.MASKED if causal else PieceKind.FULL
    ref = ReferenceBackend()
    q64, k64, v64, dout64 = (t.double().cpu() for t in (q, k, v, dout))
    want_out, want_lse = ref.forward(q64, k64, v64, kind=piece, scale=scale, q_pos=q_pos,
                                     k_pos=k_pos)
    want_out = torch.where(torch.isneginf(want_lse)[..., None], 0.0, want_out)
    want_grads = ref.backward(dout64, q64, k64, v64, want_out, want_lse, kind=piece,
                              scale=scale, q_pos=q_pos, k_pos=k_pos)
    out, lse = block_forward(q, k, v, q_pos, k_pos, causal=causal, scale=scale)
    grads = block_backward(dout, q, k, v, lse, softmax_delta(dout, want_out.to(device)),
                           q_pos, k_pos, causal=causal, scale=scale)
    short_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    name = f"{short_dtype} {'causal' if causal else 'full'} {pattern}"
    errors, tolerances = {}, {}
    for what, got, want in (("out", out, want_out), *zip(("dq", "dk", "dv"), grads,
                                                         want_grads, strict=True)):
        # float32: 1e-4 absolute; bfloat16 rounds P and dS before their products: 2% of the
        # tensor's largest magnitude (and at least 1e-6 where everything is 0).
        tolerances[what] = (1e-4 if dtype == torch.float32
                            else max(2e-2 * want.abs().max().item(), 1e-6))
        error = (got.double().cpu() - want).abs().max().item()
        errors[what] = error if torch.isfinite(got).all() else float("inf")
    finite = ~torch.isneginf(want_lse)
    same_empty = torch.equal(torch.isneginf(lse.cpu()), ~finite)
    lse_error = ((lse.double().cpu()[finite] - want_lse[finite]).abs().max().item()
                 if finite.any() else 0.0)
    errors["lse"] = lse_error if same_empty else float("inf")  # -inf exactly where expected
    tolerances["lse"] = 1e-4
    passed = all(errors[w] <= tolerances[w] for w in errors)
    return SmokeRow(name, errors, tolerances, passed)


def run_smoke(device: torch.device) -> list[SmokeRow]:
    """Forward output and LSE, dq, dk, dv of the kernels against the float64 reference, in
    small shapes (GQA 4:2, head_dim 80), float32 and bfloat16, causal and full."""
    from ringray.attention.backends.triton_common import kernels_interpreted

    if device.type == "cpu" and not kernels_interpreted():
        raise RuntimeError(
            "the Triton kernels were defined without TRITON_INTERPRET=1, so they cannot run "
            "on CPU; set it before ringray's Triton modules are imported"
        )
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (True, False):
            for pattern in SMOKE_PATTERNS if causal else ("zigzag 1<-0",):
                rows.append(_smoke_case(device, dtype, pattern, causal))
    return rows


# ---------------------------------------------------------------- launch-shape sweep

@dataclass(frozen=True)
class SweepRow:
    kernel: str  # forward | backward
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ms: float | None  # None: the shape does not compile (e.g. out of shared memory)
    in_table: bool


def _candidates(kernel: str):
    from ringray.attention.backends.triton_config import TileConfig

    shapes = {  # (block_m candidates, block_n candidates)
        "forward": ((64, 128), (32, 64, 128)),
        "backward": ((16, 32, 64), (64, 128)),  # block_n keys resident per program
    }[kernel]
    # Stages matter in the unmasked main loop over full tiles, which holds most of the work.
    return [TileConfig(m, n, w, s) for m in shapes[0] for n in shapes[1]
            for w in (4, 8) for s in (2, 3, 4, 5)]


def run_sweep(cfg: KernelBenchConfig, seq: int, causal: bool) -> list[SweepRow]:
    """Time every candidate launch shape of each kernel at one (seq, mask): the data to
    re-derive :mod:`~ringray.attention.backends.triton_config` on this GPU. Tile lists are
    cached per tile shape, so each candidate builds its own once, in its warmup."""
    from triton import CompilationError
    from triton.runtime.errors import OutOfResources

    from ringray.attention.backends.triton_backward import block_backward
    from ringray.attention.backends.triton_config import kernel_configs
    from ringray.attention.backends.triton_forward import block_forward

    device = torch.device("cuda")
    q, k, v, dout = _inputs(cfg, seq, device)
    table = kernel_configs(cfg.head_dim, q.dtype, device)
    scale = cfg.head_dim**-0.5
    pos, key = one_block(seq, device)
    out, lse = block_forward(q, k, v, pos, pos, causal=causal, scale=scale, key=key)
    delta = softmax_delta(dout, out.to(q.dtype))
    rows = []
    for kernel in ("forward", "backward"):
        for cand in _candidates(kernel):
            if kernel == "forward":
                def run(c=cand):
                    block_forward(q, k, v, pos, pos, causal=causal, scale=scale, key=key,
                                  config=c)
            else:
                def run(c=cand):
                    block_backward(dout, q, k, v, lse, delta, pos, pos, causal=causal,
                                   scale=scale, key=key, config=c)
            try:
                ms = cuda_median_ms(run, cfg.warmup, cfg.iters)
            except (OutOfResources, CompilationError):
                ms = None
            rows.append(SweepRow(kernel, cand.block_m, cand.block_n, cand.num_warps,
                                 cand.num_stages, ms, cand == getattr(table, kernel)))
    return rows


# ---------------------------------------------------------------- tables


def _mask(causal: bool) -> str:
    return "causal" if causal else "full"


def smoke_table(rows: list[SmokeRow]) -> Table:
    table = Table(title="correctness smoke: largest absolute error against the float64 "
                  "reference (float32: 1e-4; bfloat16: 2% of the largest value, LSE 1e-4)",
                  title_justify="left")
    for col in ("case", *SMOKE_QUANTITIES, "result"):
        table.add_column(col, justify="left" if col == "case" else "right", no_wrap=True)
    for r in rows:
        table.add_row(r.case, *(f"{r.max_errors[w]:.0e}" for w in SMOKE_QUANTITIES),
                      "pass" if r.passed else "FAIL")
    return table


def speed_table(rows: list[SpeedRow]) -> Table:
    table = Table(title="forward / backward TFLOP/s (causal FLOPs counted as half); "
                  "x flash = triton / sdpa-flash", title_justify="left")
    for col in ("seq", "mask", "impl", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s",
                "fwd x flash", "bwd x flash"):
        table.add_column(col, justify="right", no_wrap=True)
    flash = {(r.seq, r.causal): r for r in rows if r.impl == "sdpa-flash"}
    for r in rows:
        base = flash.get((r.seq, r.causal))
        fwd_x = f"{r.forward_tflops / base.forward_tflops:.2f}" if base else "n/a"
        bwd_x = f"{r.backward_tflops / base.backward_tflops:.2f}" if base else "n/a"
        table.add_row(str(r.seq), _mask(r.causal), r.impl, f"{r.forward_ms:.3f}",
                      f"{r.forward_tflops:.1f}", f"{r.backward_ms:.3f}",
                      f"{r.backward_tflops:.1f}", fwd_x, bwd_x)
    return table


def virtual_ring_table(rows: list[VirtualRingRow]) -> Table:
    table = Table(title="virtual ring on one GPU vs one SDPA flash call (ratio of times; "
                  "1.00 = no overhead)", title_justify="left")
    for col in ("seq", "mask", "blocks", "layout", "fwd ms", "sdpa fwd ms", "fwd ratio",
                "bwd ms", "sdpa bwd ms", "bwd ratio"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(str(r.seq), _mask(r.causal), str(r.blocks), r.layout,
                      f"{r.forward_ms:.3f}", f"{r.sdpa_forward_ms:.3f}",
                      f"{r.forward_ratio:.3f}", f"{r.backward_ms:.3f}",
                      f"{r.sdpa_backward_ms:.3f}", f"{r.backward_ratio:.3f}")
    return table


def sweep_table(rows: list[SweepRow]) -> Table:
    table = Table(title="launch-shape sweep (* = the table's entry)", title_justify="left")
    for col in ("kernel", "block_m", "block_n", "warps", "stages", "ms", ""):
        table.add_column(col, justify="right", no_wrap=True)
    for r in sorted(rows, key=lambda r: (r.kernel, r.ms is None, r.ms or 0.0)):
        table.add_row(r.kernel, str(r.block_m), str(r.block_n), str(r.num_warps),
                      str(r.num_stages), f"{r.ms:.3f}" if r.ms is not None else "no fit",
                      "*" if r.in_table else "")
    return table
