"""`make gpu-check` exists and, on a machine without a GPU, is a dry run that says so and lists
what it would run (the command is checked here even though its figures need a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it runs for real")
def test_gpu_check_is_a_dry_run_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU and there is none here: dry run" in done.stdout
    for step in ("pytest -q -m gpu", "bench kernel --seqs 8192,32768,131072",
                 "--head-dim 64", "--head-dim 128", "bench train --gpu --seq 16384"):
        assert step in done.stdout, step


def test_the_makefile_has_the_target() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "gpu-check:" in makefile and "benchmarks/gpu_check.py" in makefile
