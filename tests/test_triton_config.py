"""The Triton kernels' tile tables: which table a GPU gets from its compute capability, and
that every entry fits the shared memory of the GPUs that get it, checked without a GPU.

Choosing is pure (``tile_table(capability)``): sm_90 and sm_100 share the H100 table,
sm_80/sm_87 get the A100 one, sm_86/sm_89/sm_120 the 99 KiB one, sm_75 the 64 KiB one, and
a capability the table does not know falls back to the smallest budget of its major
version (99 KiB for an unknown major from Ampere on). Fitting is a compiler fact:
``triton_inspect`` lowers each launch for the architecture and reads the shared memory
Triton will ask for at launch (``metadata.shared``), which must stay within the budget
(the CUDA programming guide's maximum per block). From sm_80 on both loops of each kernel
must also be software-pipelined (asynchronous copies in the loop); sm_75 has none.

The kernels must be compiled, not interpreted, so compiling runs in a child process without
``TRITON_INTERPRET``; each compile takes a few seconds (sm_75 up to ten). ``make test``
compiles the head_dim 128 half-precision entries (the largest tiles of each table) on one
GPU of each table; the ``slow`` sweep compiles every entry on every listed architecture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton_config = pytest.importorskip("ringray.attention.backends.triton_config")
KIB = 1024

# The architectures compiled for, and the table each must get.
ARCHES = {90: "SM90_TABLE", 100: "SM90_TABLE", 80: "SM80_TABLE", 86: "SM86_TABLE",
          89: "SM86_TABLE", 120: "SM86_TABLE", 75: "SM75_TABLE"}
REPRESENTATIVE = (90, 80, 86)

CHILD = """
import dataclasses, json, sys, warnings
import torch
warnings.filterwarnings("ignore")
from ringray.attention.backends.triton_inspect import inspect_kernel
dtypes = {"half": torch.float16, "float32": torch.float32}
for kernel, arch, head_dim, dtype in json.loads(sys.argv[1]):
    report = inspect_kernel(kernel, head_dim=head_dim, dtype=dtypes[dtype], causal=True,
                            documents=True, arch=arch)
    print(json.dumps({"kernel": kernel, "arch": arch, "head_dim": head_dim, "dtype": dtype,
                      **dataclasses.asdict(report)}), flush=True)
"""


def _capability(arch: int) -> tuple[int, int]:
    return arch // 10, arch % 10


@pytest.mark.parametrize("arch,table", list(ARCHES.items()))
def test_each_gpu_gets_the_table_for_its_shared_memory(arch: int, table: str) -> None:
    assert triton_config.tile_table(_capability(arch)) is getattr(triton_config, table)


def test_unknown_capabilities_fall_back_to_the_smallest_budget_they_may_have() -> None:
    """sm_101 (unknown minor of a known major) gets sm_100's budget; an unknown major from
    Ampere on gets 99 KiB (the 99 KiB table); before Ampere 48 KiB, which no table fits."""
    assert triton_config.shared_bytes_per_block((10, 1)) == 227 * KIB
    assert triton_config.shared_bytes_per_block((8, 8)) == 99 * KIB  # sm_86/89's, not sm_80's
    assert triton_config.tile_table((13, 0)) is triton_config.SM86_TABLE
    assert triton_config.tile_table((7, 6)) is triton_config.SM75_TABLE
    with pytest.raises(ValueError, match="sm_61 gives a block 48 KiB"):
        triton_config.tile_table((6, 1))


def test_every_table_covers_the_same_head_dims_and_dtypes() -> None:
    keys = set(triton_config.CUDA_TABLE)
    for _, table in triton_config.TABLES_BY_BUDGET:
        assert set(table) == keys


def test_configs_by_device_and_capability() -> None:
    """CPU (the interpreter) gets 32 × 32 tiles; a CUDA capability its table's entry, head
    dims padded to a power of two; past the largest head dim, an error naming it."""
    assert triton_config.kernel_configs(80, torch.bfloat16, torch.device("cpu")) \
        == triton_config.INTERPRETER
    assert triton_config.cuda_kernel_configs(80, torch.bfloat16, (8, 0)) \
        == triton_config.SM80_TABLE[(128, "half")]
    assert triton_config.cuda_kernel_configs(64, torch.float32, (9, 0)) \
        == triton_config.CUDA_TABLE[(64, "float32")]
    with pytest.raises(ValueError, match="head_dim: 512"):
        triton_config.cuda_kernel_configs(512, torch.float16, (9, 0))


def _compile(launches: list[tuple[str, int, int, str]]) -> list[dict]:
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile for")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(launches)], env=env,
                            capture_output=True, text=True, timeout=3000, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def _assert_fit(reports: list[dict]) -> None:
    misfits = []
    for report in reports:
        budget = triton_config.shared_bytes_per_block(_capability(report["arch"]))
        pipelined = report["arch"] < 80 or (len(report["pipelined_loops"]) == 2 and all(
            copies > 0 for copies in report["pipelined_loops"]))
        if report["shared_bytes"] > budget or not pipelined:
            misfits.append(f"{report} (budget {budget} bytes)")
    assert not misfits, "\n".join(misfits)


def test_largest_entries_fit_their_gpus() -> None:
    """Head dim 128, half precision, both kernels, on sm_90, sm_80 and sm_86."""
    _assert_fit(_compile([(kernel, arch, 128, "half") for arch in REPRESENTATIVE
                          for kernel in ("forward", "backward")]))


@pytest.mark.slow
def test_every_entry_fits_every_gpu_of_its_table() -> None:
    """Every entry, both kernels, on each architecture of :data:`ARCHES` (about 140
    compiles: several minutes)."""
    launches = [(kernel, arch, head_dim, dtype) for arch, table in ARCHES.items()
                for head_dim, dtype in getattr(triton_config, table)
                for kernel in ("forward", "backward")]
    _assert_fit(_compile(launches))
