"""`make gpu-check`, the one command for the first GPU run, on a machine without a GPU is a dry
run that says so and lists what it would run (the command itself is checked here even though
its figures need a GPU)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.executable).parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it runs for real")
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_is_a_dry_run_without_a_gpu() -> None:
    # -o: take this environment as set up (never reinstall it from here)
    stamp = VENV / ".ringray-installed"
    done = subprocess.run(["make", "-s", "-o", str(stamp), "gpu-check", f"VENV={VENV}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU and there is none here: dry run" in done.stdout
    for step in ("pytest -q -m gpu", "bench kernel --seqs 8192,32768,131072",
                 "--head-dim 64", "--head-dim 128", "bench train --gpu --seq 16384",
                 "benchmarks/gpu-check-<gpu>.json"):
        assert step in done.stdout, step
