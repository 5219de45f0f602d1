"""Tile sizes, warps and pipeline stages of the Triton kernels, per head_dim and dtype.

    configs = kernel_configs(head_dim=128, dtype=torch.bfloat16, device=q.device)
    configs.forward.block_m  # 128

A static table rather than ``triton.autotune``: the ring calls the kernels with the same
shapes every step, and a table keeps the choice visible, reviewable and free of first-call
tuning runs inside a training step. ``ringray bench kernel --sweep`` times the candidates
around an entry on a GPU, so the table can be re-derived on new hardware. A tile shape
also keys the cached tile lists (:mod:`.triton_tiles`): forward and backward with different
shapes keep one entry each per block pair.

``num_stages`` is the depth of Triton's software pipeline in the kernels' loops, above all
the unmasked main loop over full tiles, which holds most of the work (the masked loop over
straddling tiles has a few tiles per row on a causal diagonal). The tile index read from
the list takes one stage: compiled for sm_90 with 3 stages, a loop loads the next K/V
(forward) or Q/dO (backward) tile while it computes on the current one, and the index two
ahead.

The CUDA entries are starting points for an H100 taken from the shapes that work for
flash-attention-style Triton kernels there (forward: 128 queries × 64 keys per program,
3 stages; backward: 128 keys per program, resident with their float32 dK/dV, stepping
through 32 queries at a time, as in Triton's fused-attention tutorial and flash-attention
2, which the backward's single-pass design follows), then checked by compiling each entry
for sm_90a without a GPU (:mod:`.triton_inspect`, Triton 3.9): every entry pipelines both
loops of its kernel and fits in shared memory, and the entries that spilled registers there
were changed for ones that do not (float32 now gets its own, 8-warp entries), except where
noted below. The head_dim 64 and 128 half entries were then replaced by the fastest of a
sweep on an H200 (2026-11-25, ``benchmarks/RESULTS.md``); the rest are untimed. Interpreter
runs (CPU) use 32 × 32 tiles: big enough to exercise multi-tile loops on small test blocks,
small enough to keep numpy's work per program low.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringray.attention.backends.triton_common import padded_head_dim


@dataclass(frozen=True)
class TileConfig:
    """One kernel launch's shape: ``block_m`` query rows × ``block_n`` keys per tile pair,
    ``num_warps`` per program, ``num_stages`` of software pipelining in the main loop."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfigs:
    """Launch shapes of the two kernels for one (head_dim, dtype)."""

    forward: TileConfig  # one program per query tile, looping over key tiles
    backward: TileConfig  # one program per key tile (dK, dV; dQ by atomics), over query tiles


# (padded head_dim, "half" | "float32") -> configs, for CUDA (H100-class) devices.
# Register use compiled for sm_90a (triton_inspect): no spills but where a comment says.
CUDA_TABLE: dict[tuple[int, str], KernelConfigs] = {
    (16, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    (32, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    # head_dim 64 and 128: the fastest of `ringray bench kernel --sweep` on an H200 (16k
    # tokens, causal, bf16; benchmarks/RESULTS.md). Against the starting points (128x64 with
    # 4 and 3 stages forward, 32x128x8x3 backward): forward 12% and 14% faster, backward 1.46x
    # and 1.30x. The 64-query backward spills a little more at 128 than the 32-query one did,
    # and is faster all the same.
    (64, "half"): KernelConfigs(TileConfig(128, 64, 4, 5), TileConfig(64, 128, 8, 2)),
    (128, "half"): KernelConfigs(TileConfig(128, 64, 8, 5), TileConfig(64, 128, 8, 2)),
    # forward: 64 bytes of spill stores (32 × 64 does not spill but gives up wgmma's
    # 64-row minimum per warp group).
    (256, "half"): KernelConfigs(TileConfig(64, 32, 8, 2), TileConfig(32, 32, 8, 2)),
    # float32 operands take twice the shared memory per tile and multiply in IEEE float32
    # on the CUDA cores (float32 is the correctness path, not the fast one): small tiles
    # over 8 warps, where 4 spilled heavily.
    (16, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (32, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (64, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (128, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (256, "float32"): KernelConfigs(TileConfig(32, 32, 8, 2), TileConfig(16, 32, 8, 2)),
}
INTERPRETER = KernelConfigs(TileConfig(32, 32), TileConfig(32, 32))


def kernel_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> KernelConfigs:
    """The table entry for ``head_dim`` (padded to a power of two) and ``dtype``."""
    if device.type != "cuda":
        return INTERPRETER
    width = padded_head_dim(head_dim)
    entry = (width, "float32" if dtype == torch.float32 else "half")
    if entry not in CUDA_TABLE:
        raise ValueError(
            f"head_dim: {head_dim} (padded to {width}) has no Triton kernel config; "
            f"supported up to {max(w for w, _ in CUDA_TABLE)}"
        )
    return CUDA_TABLE[entry]
