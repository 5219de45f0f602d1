"""`make gpu-check`, the one command for a lent GPU, checked on a machine without one: it never
passes without the GPU it was meant for, and its phases run (at CPU scale) everywhere.

- With no GPU it is a dry run that says so, runs every phase small (Triton's interpreter) and
  writes its figures to the file it was given, never under ``benchmarks/``.
- With a GPU that torch cannot use (here: ``nvidia-smi`` lists one, torch is a CPU build) it
  fails in one line, exit 2, and runs nothing.
- The correctness check fails a kernel that is wrong by a few percent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringray.bench.ring_kernel_check import check_case

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PHASES = ("versions", "correctness", "overflow", "kernel-speed", "plan", "gpu-tests")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it runs for real")


def _fake_nvidia_smi(bin_dir: Path) -> None:
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000)'\n")
    smi.chmod(0o755)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_without_a_gpu_is_a_dry_run_whose_phases_pass(tmp_path: Path) -> None:
    out = tmp_path / "dry.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}",
         f"GPU_CHECK_ARGS=--quick --out {out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert "no GPU here" in done.stdout and "dry run" in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert [phase["name"] for phase in report["phases"]] == list(PHASES)
    failed = {p["name"]: p.get("error") or p.get("output_tail") for p in report["phases"]
              if not p["passed"]}
    assert not failed, failed
    assert done.returncode == 0, done.stdout + done.stderr
    correctness = next(p for p in report["phases"] if p["name"] == "correctness")
    assert "triton" in correctness["backends"] and correctness["checked"] >= 6
    assert not list((ROOT / "benchmarks").glob("gpu-check-none*.json"))


def test_a_gpu_that_torch_cannot_use_fails_and_runs_nothing(tmp_path: Path) -> None:
    _fake_nvidia_smi(tmp_path)
    out = tmp_path / "never.json"
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "NVIDIA H200" in done.stderr and "CPU build" in done.stderr
    assert "dry run" not in done.stdout
    assert not out.exists()


class _ThreePercentOff:
    """The sdpa backend with every output 3 % too large: a kernel that is nearly right."""

    name = "sdpa-off"

    def __init__(self) -> None:
        from ringray.attention.backends import SdpaBackend

        self._inner = SdpaBackend()

    def supports(self, device, dtype):
        return self._inner.supports(device, dtype)

    def forward(self, *args, **kwargs):
        out, lse = self._inner.forward(*args, **kwargs)
        return out * 1.03, lse

    def backward(self, *args, **kwargs):
        return self._inner.backward(*args, **kwargs)


def test_the_correctness_check_fails_a_kernel_that_is_three_percent_off() -> None:
    device = torch.device("cpu")
    right = check_case("sdpa", (4, 1, 80), "zigzag causal", device, block_tokens=40)
    wrong = check_case(_ThreePercentOff(), (4, 1, 80), "zigzag causal", device,
                       block_tokens=40)
    assert right.passed, right.errors
    assert not wrong.passed and wrong.errors["out"] > wrong.tolerances["out"], wrong.errors
