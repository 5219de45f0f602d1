"""Tile sizes, warps and pipeline stages of the Triton kernels, per head_dim and dtype.

    configs = kernel_configs(head_dim=128, dtype=torch.bfloat16, device=q.device)
    configs.forward.block_m  # 128

A static table rather than ``triton.autotune``: the ring calls the kernels with the same
shapes every step, and a table keeps the choice visible, reviewable and free of first-call
tuning runs inside a training step. ``ringray bench kernel --sweep`` times the candidates
around an entry on a GPU, so the table can be re-derived on new hardware.

The CUDA entries are starting points for an H100 taken from the shapes that work for
flash-attention-style Triton kernels there (forward: 128 queries × 64 keys per program;
backward: 32 × 128 for dK/dV, which keeps K/V and their float32 gradients resident, and
128 × 32 for dQ). They have not been measured by this project yet: no GPU was available
when they were written. Interpreter runs (CPU) use 32 × 32 tiles: big enough to exercise
multi-tile loops on small test blocks, small enough to keep numpy's work per program low.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringray.attention.backends.triton_common import padded_head_dim


@dataclass(frozen=True)
class TileConfig:
    """One kernel launch's shape: ``block_m`` query rows × ``block_n`` keys per program."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfigs:
    """Launch shapes of the three kernels for one (head_dim, dtype)."""

    forward: TileConfig
    backward_dkdv: TileConfig  # one program per key tile: dK, dV
    backward_dq: TileConfig  # one program per query tile: dQ


# (padded head_dim, "half" | "float32") -> configs, for CUDA (H100-class) devices.
CUDA_TABLE: dict[tuple[int, str], KernelConfigs] = {
    (16, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4),
                                TileConfig(128, 32, 4, 4)),
    (32, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4),
                                TileConfig(128, 32, 4, 4)),
    (64, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 5),
                                TileConfig(128, 32, 4, 5)),
    (128, "half"): KernelConfigs(TileConfig(128, 64, 8, 3), TileConfig(32, 128, 8, 3),
                                 TileConfig(128, 32, 8, 3)),
    (256, "half"): KernelConfigs(TileConfig(64, 32, 8, 2), TileConfig(32, 64, 8, 2),
                                 TileConfig(64, 32, 8, 2)),
}
# float32 operands take twice the shared memory per tile and run at a fraction of the MMA
# rate: small tiles everywhere (float32 is the correctness path, not the fast one).
CUDA_FLOAT32 = KernelConfigs(TileConfig(64, 32, 4, 2), TileConfig(32, 64, 4, 2),
                             TileConfig(64, 32, 4, 2))
INTERPRETER = KernelConfigs(TileConfig(32, 32), TileConfig(32, 32), TileConfig(32, 32))


def kernel_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> KernelConfigs:
    """The table entry for ``head_dim`` (padded to a power of two) and ``dtype``."""
    if device.type != "cuda":
        return INTERPRETER
    if dtype == torch.float32:
        return CUDA_FLOAT32
    width = padded_head_dim(head_dim)
    if (width, "half") not in CUDA_TABLE:
        raise ValueError(
            f"head_dim: {head_dim} (padded to {width}) has no Triton kernel config; "
            f"supported up to {max(w for w, _ in CUDA_TABLE)}"
        )
    return CUDA_TABLE[(width, "half")]
