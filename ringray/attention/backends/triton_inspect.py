"""Compile the Triton kernels for an NVIDIA GPU on a machine without one, and report what
the compiler made of them: which loops it software-pipelined, shared memory, registers.

    report = inspect_kernel("forward", head_dim=128, dtype=torch.bfloat16, causal=True)
    report.pipelined_loops   # async copies issued in each innermost loop: (8, 7)
    report.shared_bytes, report.registers, report.spill_bytes

The launch is the one :func:`~.triton_forward.block_forward` / ``block_backward`` would
make (:func:`~.triton_forward.forward_launch`), built on small CPU tensors with the tile
table's entry for ``arch`` and the CUDA dot mode, and specialised the way Triton's launcher
specialises real calls (an integer argument of 1 becomes a constant, multiples of 16 are
marked so, pointers are 16-byte aligned). ``triton.compile`` then lowers it for ``arch``
(90: H100; 80: A100; 86, 89, 100, 120, 75...) down to a cubin; nothing runs.
``shared_bytes`` is what Triton checks against the GPU's shared memory per block at launch
(:data:`~.triton_config.SHARED_BYTES_PER_BLOCK`). A loop counts as pipelined when
Triton's pipeliner turned its loads into asynchronous copies to shared memory
(``ttg.async_copy_global_to_local`` in the loop body of the TTGIR), which it only does for
loads it can issue ahead of the iteration that uses them (from sm_80 on). Registers and
spills come from ``ptxas -v`` when Triton's ptxas is found.

It needs the kernels compiled, not interpreted: run it in a process without
``TRITON_INTERPRET=1`` (the tests start one). What it cannot tell is speed: timing needs a
GPU (``ringray bench kernel``).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ringray.attention.backends import triton_backward, triton_forward
from ringray.attention.backends.triton_common import KernelLaunch, dot_mode
from ringray.attention.backends.triton_config import TileConfig, cuda_kernel_configs

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.int32: "i32"}


@dataclass(frozen=True)
class KernelReport:
    kernel: str  # forward | backward
    config: TileConfig
    pipelined_loops: tuple[int, ...]  # async copies in each innermost loop, in source order
    shared_bytes: int
    registers: int | None  # None: no ptxas found
    spill_bytes: int | None


def inspect_kernel(
    kernel: str, *, head_dim: int, dtype: torch.dtype, causal: bool = True,
    documents: bool = False, config: TileConfig | None = None, arch: int = 90,
) -> KernelReport:
    """Compile ``kernel`` (``"forward"`` or ``"backward"``) for ``sm_{arch}`` with
    ``config`` (default: the entry of that architecture's tile table) and report on it."""
    if not isinstance(triton_forward._forward_kernel, triton.JITFunction):
        raise RuntimeError("the kernels are interpreted here (TRITON_INTERPRET=1): inspect "
                           "them in a process without it")
    table = cuda_kernel_configs(head_dim, dtype, (arch // 10, arch % 10))
    cfg = config or getattr(table, kernel)
    launch, fn = _launch(kernel, head_dim, dtype, causal, documents, cfg)
    upcast, precision = dot_mode(dtype, torch.device("cuda"))
    constexprs = {**launch.kwargs, "UPCAST": upcast, "PRECISION": precision}
    options = {"num_warps": constexprs.pop("num_warps"),
               "num_stages": constexprs.pop("num_stages")}
    signature, attrs = {}, {}
    for index, (name, value) in enumerate(zip(fn.arg_names, launch.args, strict=False)):
        kind, divisible = _specialise(value)
        if kind == "constexpr":
            constexprs[name] = value
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
        signature[name] = kind
    for name in constexprs:
        signature[name] = "constexpr"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, spills = _ptxas_usage(compiled.asm["ptx"], arch)
    return KernelReport(kernel, cfg, innermost_loop_copies(compiled.asm["ttgir"]),
                        compiled.metadata.shared, registers, spills)


def _launch(kernel: str, head_dim: int, dtype: torch.dtype, causal: bool, documents: bool,
            cfg: TileConfig) -> tuple[KernelLaunch, triton.JITFunction]:
    """The launch for a 256-token block pair (a multiple of every tile, as long training
    blocks are), GQA 4:2, with its kernel."""
    seq, q_heads, kv_heads = 256, 4, 2
    q, dout = (torch.zeros(1, q_heads, seq, head_dim, dtype=dtype) for _ in range(2))
    k, v = (torch.zeros(1, kv_heads, seq, head_dim, dtype=dtype) for _ in range(2))
    pos = torch.arange(seq)
    doc = torch.div(pos, 64, rounding_mode="floor") if documents else None
    tokens = {"causal": causal, "scale": head_dim**-0.5, "q_doc": doc, "k_doc": doc,
              "key": None, "config": cfg, "visits": None}
    f32 = {"dtype": torch.float32}
    if kernel == "forward":
        out, lse = torch.zeros(q.shape, **f32), torch.zeros(q.shape[:3], **f32)
        return (triton_forward.forward_launch(q, k, v, pos, pos, out, lse, merge=True,
                                              **tokens), triton_forward._forward_kernel)
    lse, delta = torch.zeros(q.shape[:3], **f32), torch.zeros(q.shape[:3], **f32)
    grads = (torch.zeros(q.shape, **f32), torch.zeros(k.shape, **f32),
             torch.zeros(k.shape, **f32))
    return (triton_backward.backward_launch(dout, q, k, v, lse, delta, pos, pos, *grads,
                                            **tokens), triton_backward._backward_kernel)


def _specialise(value: torch.Tensor | int | float) -> tuple[str, bool]:
    """``(signature type, divisible by 16)`` of one launch argument, as Triton's launcher
    specialises it."""
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPES[value.dtype], True  # allocations are 256-byte aligned
    if isinstance(value, float):
        return "fp32", False
    if value == 1:
        return "constexpr", False
    return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0


def innermost_loop_copies(ttgir: str) -> tuple[int, ...]:
    """Asynchronous global-to-shared copies inside each innermost ``scf.for`` of a TTGIR
    listing (loops nest by indentation), in order."""
    lines = ttgir.splitlines()
    counts = []
    for start, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for inner in lines[start + 1:]:
            if inner.strip() and len(inner) - len(inner.lstrip()) <= indent:
                break  # the loop's closing brace
            body.append(inner)
        if not any("scf.for" in inner for inner in body):
            counts.append(sum("async_copy_global_to_local" in inner for inner in body))
    return tuple(counts)


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """``(registers, spill-store bytes)`` from ``ptxas -v``; ``(None, None)`` without it."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except (ImportError, AttributeError, RuntimeError):
        return None, None
    suffix = "a" if arch >= 90 else ""  # sm_90a: the variant with wgmma that Triton targets
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        result = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", str(path),
                                 "-o", str(path.with_suffix(".cubin"))],
                                capture_output=True, text=True, check=False)
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    if registers is None or spills is None:
        return None, None
    return int(registers.group(1)), int(spills.group(1))
