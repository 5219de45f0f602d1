"""On a CUDA GPU, `ringray train` with ``cluster.accelerator: gpu`` trains through Ray worker
actors set up as Ray Train sets them up (the node's GPUs visible, the worker's own made
current in every call, an NCCL group with the job's timeout), checkpoints, resumes and
evaluates, on an embedded local Ray that found the GPU itself.

``tests/test_worker_devices.py`` checks the device plan on every machine with GPUs that Ray
nodes only declare; this is the same path with a real device. Part of ``make gpu-check``;
skipped without a GPU (conftest.py) or without Ray (a bare GPU image).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringray", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=500)


def test_a_gpu_job_trains_on_the_gpu_through_ray_workers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = ["--set", "name=gpu-ray", "--set", f"run_dir={run_dir}",
           "--set", "cluster.accelerator=gpu", "--set", "parallel.cp=1",
           "--set", "train.precision=bf16", "--set", "train.seq_len=1024",
           "--set", "checkpoint.interval=2", "--set", "eval.passkey_lengths=[1024]",
           "--set", "eval.passkey_samples=1"]
    first = _train("train", "jobs/quickstart.yaml", "--steps", "2", *job)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "job 'gpu-ray' finished at step 2/2" in first.stdout
    again = _train("resume", str(run_dir), "--steps", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished at step 3/3" in again.stdout
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # The peak is CUDA's allocator's (torch.cuda.max_memory_allocated): the debug model's
    # step needs tens of MiB there. On the host it would be the worker's resident set, over
    # 250 MiB once torch is imported.
    assert all(0 < s["peak_memory_bytes"] < 250 << 20 for s in steps), steps
    assert (run_dir / "passkey.json").exists()
