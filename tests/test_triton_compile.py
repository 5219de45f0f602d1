"""The Triton kernels compile for an H100 (sm_90) and their loops are software-pipelined,
checked on a machine without a GPU: ``triton_inspect`` lowers the launch ``block_forward``
/ ``block_backward`` would make, with the CUDA tile table's entry, down to a cubin.

Pinned: both loops of each kernel (full tiles, unmasked; straddling tiles, masked) issue
their loads as asynchronous copies to shared memory, which Triton's pipeliner does only for
a loop it pipelines; the kernels fit an H100's 227 KiB of shared memory per block. The old
design's single key loop, with its loads under a data-dependent branch, had no async copy.
Speed is out of reach here (``ringray bench kernel`` on a GPU). The kernels must be compiled,
not interpreted, so this runs in a child process without ``TRITON_INTERPRET``; each compile
takes several seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

H100_SHARED_BYTES = 227 * 1024
CHILD = """
import dataclasses, json, sys, warnings
import torch
warnings.filterwarnings("ignore")
from ringray.attention.backends.triton_inspect import inspect_kernel
reports = [dataclasses.asdict(inspect_kernel(kernel, head_dim=128, dtype=torch.bfloat16,
                                             causal=True, documents=True))
           for kernel in ("forward", "backward")]
print(json.dumps(reports))
"""


def test_kernels_compile_for_h100_with_pipelined_loops() -> None:
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile for")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    for report in reports:
        print(report)
        assert len(report["pipelined_loops"]) == 2, report  # full, then straddling
        assert all(copies > 0 for copies in report["pipelined_loops"]), report
        assert report["shared_bytes"] <= H100_SHARED_BYTES, report
