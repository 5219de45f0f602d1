"""``python -m ringray.train`` under torchrun, as the README runs it: a short job writes its
run directory (steps.jsonl with every StepStats field, checkpoints, passkey.json), a rerun
resumes, and bad specs fail before training with the field named."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringray.spec import load_job_spec
from ringray.spec.run_spec import load_run_spec
from ringray.train import CheckpointStore, StepStats

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "jobs/quickstart.yaml"


def _train(nproc: int, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    sets = [arg for item in overrides for arg in ("--set", item)]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), "-m", "ringray.train", "--config", str(QUICKSTART), *sets],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


def _small_job(run_dir: Path) -> list[str]:
    return [
        f"run_dir={run_dir}", "parallel.cp=2", "train.steps=3", "train.seq_len=256",
        "checkpoint.interval=2", "eval.passkey_lengths=[256]", "eval.passkey_samples=1",
        "train.peak_tflops_per_device=1.0",
    ]


def test_quickstart_spec_is_valid_as_shipped() -> None:
    spec = load_job_spec(QUICKSTART)
    assert spec.parallel.cp == 4 and spec.eval.passkey_lengths


def test_a_short_job_writes_its_run_directory_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = _train(2, *_small_job(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dp=1 × cp=2 (zigzag)" in result.stdout
    assert "passkey exact match" in result.stdout

    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    fields = {f.name for f in dataclasses.fields(StepStats)}
    for stats in steps:
        assert set(stats) == fields
        assert len(stats["attention_compute_seconds"]) == 2  # one entry per rank
        assert stats["mfu"] is not None and stats["mfu"] > 0
        assert stats["tokens"] == 2 * 256  # global batch 2
    assert sorted(p.name[:13] for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000003",
    ]
    passkey = json.loads((run_dir / "passkey.json").read_text())
    assert passkey  # the report's JSON form, written by rank 0
    # job.yaml, as `ringray train` writes it: `ringray export` and `resume` read the run.
    recorded = load_run_spec(run_dir).train_options()
    assert (recorded.run_dir, recorded.train.steps, recorded.parallel.cp) == (str(run_dir), 3, 2)

    again = _train(2, *_small_job(run_dir), "train.steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 3)" in again.stdout and "step     4/4" in again.stdout

    # Below the checkpoint's step: refused in one line (it said "resumed" and exited 0 with
    # nothing trained, before), as `ringray train` refuses it.
    below = _train(2, *_small_job(run_dir), "train.steps=2")
    assert below.returncode != 0
    (line,) = [line for line in below.stderr.splitlines() if line.startswith("error: ")]
    assert "train.steps: 2 is below step 4 of the checkpoint this run resumes" in line
    assert "set train.steps to 4 or more" in line
    assert load_run_spec(run_dir).train_options().train.steps == 4  # job.yaml left as it was


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.seq_len=1004"], "train.seq_len: 1004 cannot be split by layout 'zigzag' over "
                                  "cp=4 ranks; use a multiple of 8"),
        (["train.stepz=3"], "train.stepz: unknown field; valid: steps, global_batch"),
    ],
)
def test_a_bad_spec_names_the_field(overrides: list[str], message: str) -> None:
    result = _train(1, *overrides, timeout=120)
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # one line naming the file once (the path stood alone on a line of its own before)
    assert line.startswith(f"error: {QUICKSTART}: ") and message in line


def test_a_mesh_that_does_not_fit_the_world_shows_the_arithmetic(tmp_path: Path) -> None:
    """Refused before anything is touched: an earlier run's checkpoints stay where they are
    although the job asks to move them aside (they were moved, then the job refused, before)."""
    CheckpointStore(str(tmp_path / "checkpoints"), lineage="earlier").save(
        5, {"w": torch.zeros(2)}, keep=3)
    def listing() -> list[str]:  # the run directory's lock files aside
        return sorted(p.name for p in tmp_path.iterdir() if "lock" not in p.name)

    before = listing()
    result = _train(2, f"run_dir={tmp_path}", "checkpoint.resume=false",
                    "checkpoint.move_aside=true", timeout=120)  # the spec asks for cp=4
    assert result.returncode != 0
    assert "1 × 4 = 4, but the world has 2 rank(s)" in result.stderr
    assert "moved" not in result.stdout + result.stderr
    assert listing() == before == ["checkpoints"]


def test_an_attention_backend_this_device_lacks_is_refused_by_its_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'triton' on a CPU: refused before the model is built, naming the job's field and the
    backends that work here (it said "backend: 'triton' does not support torch.float32 on
    cpu" from inside the first forward before). Without the interpreter the tests use."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = _train(1, f"run_dir={tmp_path}", "parallel.cp=1", "parallel.attention_backend=triton",
                    timeout=120)
    assert result.returncode != 0
    assert "parallel.attention_backend: 'triton' does not support torch.float32 on cpu (this " \
           "job computes in float32 on cpu); use 'auto' or 'reference' or 'sdpa'" in result.stderr
    assert "ringray:" not in result.stdout  # no model was built
