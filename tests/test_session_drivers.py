"""One training session, two drivers: the same job under torchrun (``python -m ringray.train``)
and under Ray (the controller driving worker actors step by step) leaves the same run
directory: the same steps in ``steps.jsonl`` with the same losses, gradient norms and learning
rates, the same committed checkpoints holding the same weights, the same passkey report, and
no lock once it ends (the controller holds it while the job runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ray_cluster import cluster_options, finish, start_job, wait_until
from train_cases import changed, weights_from_checkpoint

from ringray.spec import load_job_spec
from ringray.train.checkpoint import CheckpointStore
from ringray.train.run_lock import LOCK_NAME, RunLock

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "jobs/quickstart.yaml"
# The fields of a StepStats that training decides (the rest are timings).
DECIDED = ("step", "loss", "grad_norm", "learning_rate", "tokens")


def _overrides(run_dir: Path) -> list[str]:
    return [f"run_dir={run_dir}", "parallel.cp=2", "train.steps=4", "train.seq_len=256",
            "checkpoint.interval=2", "eval.passkey_lengths=[256]", "eval.passkey_samples=1",
            "train.peak_tflops_per_device=1.0"]


def _torchrun(run_dir: Path) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    sets = [arg for item in _overrides(run_dir) for arg in ("--set", item)]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ringray.train", "--config", str(QUICKSTART), *sets],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _ray(local_cluster, run_dir: Path) -> None:
    tag = "slot_drivers"
    local_cluster.add_node(tag, slots=2)
    try:
        job = load_job_spec(QUICKSTART, _overrides(run_dir)).job_options()
        controller = start_job("drivers", job.train, cluster_options(tag))
        wait_until(controller, lambda s: s.step >= 1, timeout=240, what="the first step")
        holder = RunLock(run_dir, job="x").holder()
        assert holder is not None and holder.job == "drivers"  # the controller holds it
        status = finish(controller)
        assert status.state == "finished", status.error
    finally:
        local_cluster.remove_all()


def _decided_steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    return [{name: json.loads(line)[name] for name in DECIDED} for line in lines]


def _committed_steps(run_dir: Path) -> list[int]:
    return [ref.step for ref in CheckpointStore(str(run_dir / "checkpoints")).committed()]


def test_torchrun_and_ray_drive_the_same_session_to_the_same_run_directory(
        local_cluster, tmp_path: Path) -> None:
    torchrun_dir, ray_dir = tmp_path / "torchrun", tmp_path / "ray"
    _torchrun(torchrun_dir)
    _ray(local_cluster, ray_dir)

    steps = _decided_steps(torchrun_dir)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert _decided_steps(ray_dir) == steps  # bit for bit: the same session, the same numbers

    assert _committed_steps(torchrun_dir) == _committed_steps(ray_dir) == [2, 4]
    options = changed(load_job_spec(QUICKSTART, _overrides(torchrun_dir)).train_options(),
                      parallel={"cp": 1})
    want = weights_from_checkpoint(options)
    got = weights_from_checkpoint(replace(options, run_dir=str(ray_dir)))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)

    assert (json.loads((ray_dir / "passkey.json").read_text())
            == json.loads((torchrun_dir / "passkey.json").read_text()))
    assert not (torchrun_dir / LOCK_NAME).exists() and not (ray_dir / LOCK_NAME).exists()
