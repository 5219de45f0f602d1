"""Tile sizes, warps and pipeline stages of the Triton kernels, per GPU, head_dim and dtype.

    configs = kernel_configs(head_dim=128, dtype=torch.bfloat16, device=q.device)
    configs.forward.block_m  # 128 on an H100
    cuda_kernel_configs(128, torch.bfloat16, capability=(8, 0))  # an A100's, without one

A static table rather than ``triton.autotune``: the ring calls the kernels with the same
shapes every step, and a table keeps the choice visible, reviewable and free of first-call
tuning runs inside a training step. ``ringray bench kernel --sweep`` times the candidates
around an entry on a GPU, so the table can be re-derived on new hardware. A tile shape
also keys the cached tile lists (:mod:`.triton_tiles`): forward and backward with different
shapes keep one entry each per block pair.

One table per shared-memory budget, chosen by the GPU's compute capability: a block may
use 227 KiB of shared memory on sm_90 (H100, H200) and sm_100 (B200), 163 KiB on sm_80
(A100) and sm_87, 99 KiB on sm_86, sm_89 (RTX 30x0, L4, L40, RTX 40x0) and sm_120 (RTX
50x0), 64 KiB on sm_75 (T4) (:data:`SHARED_BYTES_PER_BLOCK`, from the CUDA programming
guide; Triton refuses to launch a kernel that needs more). A capability the table does not
know gets the smallest budget of its major version, or 99 KiB, the least any GPU since
Ampere offers (48 KiB before sm_80: no table fits, an error says so). sm_100 uses the
sm_90 table: its entries fit there too.

``num_stages`` is the depth of Triton's software pipeline in the kernels' loops, above all
the unmasked main loop over full tiles, which holds most of the work (the masked loop over
straddling tiles has a few tiles per row on a causal diagonal). The tile index read from
the list takes one stage: compiled for sm_90 with 3 stages, a loop loads the next K/V
(forward) or Q/dO (backward) tile while it computes on the current one, and the index two
ahead. More stages hold more tiles in shared memory at once, which is what a smaller
budget cannot afford.

The sm_90 entries (:data:`CUDA_TABLE`) are starting points for an H100 taken from the
shapes that work for flash-attention-style Triton kernels there (forward: 128 queries × 64
keys per program, 3 stages; backward: 128 keys per program, resident with their float32
dK/dV, stepping through 32 queries at a time, as in Triton's fused-attention tutorial and
flash-attention 2, which the backward's single-pass design follows), then checked by
compiling each entry for sm_90a without a GPU (:mod:`.triton_inspect`, Triton 3.9): every
entry pipelines both loops of its kernel and fits in shared memory, and the entries that
spilled registers there were changed for ones that do not, except where noted below. The
head_dim 64 and 128 half entries were then replaced by the fastest of a sweep on an H200
(2026-11-25, ``benchmarks/RESULTS.md``); the rest are untimed. The other tables are
untimed too: their entries were chosen from a few candidates compiled for sm_80 and sm_86
as ones that pipeline both loops, spill no registers and leave a margin below the budget
(82% at most, room for a compiler update), except where noted; the sm_75 table only fits.
``tests/test_triton_config.py`` compiles every entry for every architecture that gets it
(sm_100, sm_89 and sm_120 included; on sm_100 two float32 forward entries spill, 24 and
1932 bytes). Interpreter runs (CPU) use 32 × 32 tiles: big enough to exercise multi-tile
loops on small test blocks, small enough to keep numpy's work per program low.
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
    """Launch shapes of the two kernels for one (head_dim, dtype) on one kind of GPU."""

    forward: TileConfig  # a program per query tile and head loops over key tiles
    backward: TileConfig  # one per key tile and query head over query tiles (dQ by atomics)


Capability = tuple[int, int]  # (major, minor), as torch.cuda.get_device_capability gives it
TileTable = dict[tuple[int, str], KernelConfigs]  # (padded head_dim, "half" | "float32")

KIB = 1024
# Shared memory one block may use (bytes): the CUDA programming guide's maximum per thread
# block for each compute capability (the opt-in amount, which Triton checks a kernel against).
SHARED_BYTES_PER_BLOCK: dict[Capability, int] = {
    (7, 0): 96 * KIB, (7, 2): 96 * KIB, (7, 5): 64 * KIB,
    (8, 0): 163 * KIB, (8, 6): 99 * KIB, (8, 7): 163 * KIB, (8, 9): 99 * KIB,
    (9, 0): 227 * KIB,
    (10, 0): 227 * KIB, (10, 3): 227 * KIB,
    (12, 0): 99 * KIB, (12, 1): 99 * KIB,
}
SINCE_AMPERE_BYTES = 99 * KIB  # the least shared memory per block of any GPU from sm_80 on
ANY_GPU_BYTES = 48 * KIB  # what every CUDA GPU gives a block without opting in

# sm_90 (H100, H200; also sm_100). Register use compiled for sm_90a (triton_inspect): no
# spills but where a comment says.
CUDA_TABLE: TileTable = {
    (16, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    (32, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    # head_dim 64 and 128: the fastest of `ringray bench kernel --sweep` on an H200 (16k
    # tokens, causal, bf16; benchmarks/RESULTS.md). Against the starting points (128x64 with
    # 4 and 3 stages forward, 32x128x8x3 backward): forward 12% and 14% faster, backward 1.46x
    # and 1.30x (timed before the backward ran one program per query head). At 128 the
    # backward spills 76 bytes (424 with the kernel of that sweep).
    (64, "half"): KernelConfigs(TileConfig(128, 64, 4, 5), TileConfig(64, 128, 8, 2)),
    (128, "half"): KernelConfigs(TileConfig(128, 64, 8, 5), TileConfig(64, 128, 8, 2)),
    # forward: 192 bytes of spill stores (32 × 64 does not spill but gives up wgmma's
    # 64-row minimum per warp group).
    (256, "half"): KernelConfigs(TileConfig(64, 32, 8, 2), TileConfig(32, 32, 8, 2)),
    # float32 operands take twice the shared memory per tile and multiply in IEEE float32
    # on the CUDA cores (float32 is the correctness path, not the fast one): small tiles
    # over 8 warps, where 4 spilled heavily; at 128 the backward steps 16 queries at a time
    # (32 spilled 800 bytes once each program had one query head).
    (16, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (32, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (64, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (128, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(16, 32, 8, 3)),
    (256, "float32"): KernelConfigs(TileConfig(32, 32, 8, 2), TileConfig(16, 32, 8, 2)),
}
SM90_TABLE = CUDA_TABLE

# sm_80 (A100) and sm_87, 163 KiB. Without wgmma the 128-key backward tiles spill over 1 KiB
# at head_dim 128; the sm_90 forward there fits, but in 162 KiB, so it is not used.
SM80_TABLE: TileTable = {
    (16, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    (32, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    (64, "half"): KernelConfigs(TileConfig(128, 64, 8, 4), TileConfig(64, 128, 8, 2)),
    (128, "half"): KernelConfigs(TileConfig(64, 64, 4, 4), TileConfig(64, 64, 8, 2)),
    (256, "half"): KernelConfigs(TileConfig(64, 32, 8, 2), TileConfig(32, 32, 8, 2)),
    (16, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (32, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (64, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (128, "float32"): KernelConfigs(TileConfig(32, 32, 8, 3), TileConfig(16, 32, 8, 3)),
    (256, "float32"): KernelConfigs(TileConfig(32, 32, 8, 2), TileConfig(16, 32, 8, 2)),
}

# sm_86, sm_89 and sm_120, 99 KiB: fewer keys per forward step at 128 and narrower backward
# tiles at 256; float32 halves its key tiles.
SM86_TABLE: TileTable = {
    (16, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    (32, "half"): KernelConfigs(TileConfig(128, 64, 4, 3), TileConfig(32, 128, 4, 4)),
    (64, "half"): KernelConfigs(TileConfig(128, 64, 8, 4), TileConfig(64, 128, 8, 2)),
    (128, "half"): KernelConfigs(TileConfig(64, 32, 4, 4), TileConfig(64, 64, 8, 2)),
    (256, "half"): KernelConfigs(TileConfig(64, 32, 8, 2), TileConfig(16, 32, 8, 2)),
    (16, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (32, "float32"): KernelConfigs(TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (64, "float32"): KernelConfigs(TileConfig(32, 32, 8, 3), TileConfig(32, 32, 8, 3)),
    (128, "float32"): KernelConfigs(TileConfig(32, 16, 8, 3), TileConfig(16, 32, 8, 3)),
    (256, "float32"): KernelConfigs(TileConfig(32, 16, 4, 2), TileConfig(16, 16, 8, 2)),
}

# sm_75 (T4) and sm_70: Triton pipelines no loop there (no asynchronous copies before
# sm_80), and its half-precision code spills registers from head_dim 32 on (12-14 KB at
# 128); small tiles keep each kernel within 64 KiB. A fallback, not a fast path.
SM75_TABLE: TileTable = {
    (16, "half"): KernelConfigs(TileConfig(64, 32, 4, 2), TileConfig(32, 32, 4, 2)),
    (32, "half"): KernelConfigs(TileConfig(64, 32, 4, 2), TileConfig(32, 32, 4, 2)),
    (64, "half"): KernelConfigs(TileConfig(64, 32, 4, 2), TileConfig(32, 32, 4, 2)),
    (128, "half"): KernelConfigs(TileConfig(64, 32, 4, 2), TileConfig(32, 32, 4, 2)),
    (256, "half"): KernelConfigs(TileConfig(32, 16, 4, 2), TileConfig(16, 16, 4, 2)),
    (16, "float32"): KernelConfigs(TileConfig(32, 32, 4, 2), TileConfig(16, 32, 4, 2)),
    (32, "float32"): KernelConfigs(TileConfig(32, 32, 4, 2), TileConfig(16, 32, 4, 2)),
    (64, "float32"): KernelConfigs(TileConfig(32, 32, 4, 2), TileConfig(16, 32, 4, 2)),
    (128, "float32"): KernelConfigs(TileConfig(32, 16, 4, 2), TileConfig(16, 32, 4, 2)),
    # backward: 2 warps, the only shape found within 64 KiB (exactly; it spills 2.6 KB).
    (256, "float32"): KernelConfigs(TileConfig(16, 16, 4, 2), TileConfig(16, 16, 2, 2)),
}

# Tables by the shared memory their entries need, largest first: a GPU gets the first one
# its budget covers.
TABLES_BY_BUDGET: tuple[tuple[int, TileTable], ...] = (
    (227 * KIB, SM90_TABLE), (163 * KIB, SM80_TABLE), (99 * KIB, SM86_TABLE),
    (64 * KIB, SM75_TABLE),
)
INTERPRETER = KernelConfigs(TileConfig(32, 32), TileConfig(32, 32))


def shared_bytes_per_block(capability: Capability) -> int:
    """The shared memory one block may use on a GPU of ``capability``: the table's; for a
    capability it does not know, the smallest of its major version's, else
    :data:`SINCE_AMPERE_BYTES` from sm_80 on and :data:`ANY_GPU_BYTES` before."""
    if capability in SHARED_BYTES_PER_BLOCK:
        return SHARED_BYTES_PER_BLOCK[capability]
    same_major = [size for (major, _), size in SHARED_BYTES_PER_BLOCK.items()
                  if major == capability[0]]
    unknown_major = SINCE_AMPERE_BYTES if capability[0] >= 8 else ANY_GPU_BYTES
    return min(same_major, default=unknown_major)


def tile_table(capability: Capability) -> TileTable:
    """The tile table for a GPU of ``capability``: the first of :data:`TABLES_BY_BUDGET`
    whose entries fit its shared memory."""
    budget = shared_bytes_per_block(capability)
    for needs, table in TABLES_BY_BUDGET:
        if needs <= budget:
            return table
    raise ValueError(f"capability: sm_{capability[0]}{capability[1]} gives a block "
                     f"{budget // KIB} KiB of shared memory; the Triton kernels need "
                     f"{TABLES_BY_BUDGET[-1][0] // KIB} KiB")


def cuda_kernel_configs(head_dim: int, dtype: torch.dtype,
                        capability: Capability) -> KernelConfigs:
    """The entry for ``head_dim`` (padded to a power of two) and ``dtype`` in the table of a
    GPU of ``capability``."""
    table = tile_table(capability)
    width = padded_head_dim(head_dim)
    entry = (width, "float32" if dtype == torch.float32 else "half")
    if entry not in table:
        raise ValueError(
            f"head_dim: {head_dim} (padded to {width}) has no Triton kernel config; "
            f"supported up to {max(w for w, _ in table)}"
        )
    return table[entry]


def kernel_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> KernelConfigs:
    """The launch shapes for ``head_dim``, ``dtype`` and ``device``: on CUDA the entry of the
    device's table (:func:`cuda_kernel_configs` with its compute capability); elsewhere
    (Triton's interpreter) :data:`INTERPRETER`."""
    if device.type != "cuda":
        return INTERPRETER
    return cuda_kernel_configs(head_dim, dtype, torch.cuda.get_device_capability(device))
