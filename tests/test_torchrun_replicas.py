"""Replica groups under torchrun (``python -m ringray.train --replica-group I``), as torchtitan
runs torchft: one torchrun per group, each its own world and store, a torchft Lighthouse
started on its own (``torchft_lighthouse``), each group its own run directory
(``RUN/replica-<i>``). The options' errors are checked without starting anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import free_loopback_port

from ringray.spec import JobSpecError, load_job_spec
from ringray.train.__main__ import group_run, replica_membership
from ringray.train.replicas import ReplicaMembership

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "jobs" / "quickstart.yaml"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "1"]

pytestmark = pytest.mark.timeout(300)


def test_replica_groups_need_a_group_a_lighthouse_and_torchrun_each_said_in_one_line() -> None:
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29601"}
    assert replica_membership(1, None, None, {}) is None
    with pytest.raises(ValueError, match=r"^--replica-group 0: parallel.dp_replicate is 1"):
        replica_membership(1, 0, "http://h:1", torchrun)
    with pytest.raises(ValueError, match=r"^parallel.dp_replicate: 2 replica groups run as one "
                                         r"torchrun each: give each --replica-group I \(0 to 1\)"):
        replica_membership(2, None, "http://h:1", torchrun)
    with pytest.raises(ValueError, match=r"^--replica-group 1: no Lighthouse"):
        replica_membership(2, 1, None, torchrun)
    with pytest.raises(ValueError, match=r"^--replica-group 1: run under torchrun"):
        replica_membership(2, 1, "http://h:1", {})
    with pytest.raises(ValueError, match=r"^replica index: 2 is not one of the 2"):
        replica_membership(2, 2, "http://h:1", torchrun)
    member = replica_membership(2, 1, "http://h:1", torchrun)
    assert (member.index, member.count, member.store) == (1, 2, ("127.0.0.1", 29601))


def test_a_torchrun_group_takes_the_job_files_replica_timeouts_and_heal_transport() -> None:
    """Under torchrun as on Ray, the ``cluster`` section's replica settings reach the group
    (before, torchrun's groups had the defaults whatever the job file said)."""
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29601"}
    spec = load_job_spec(QUICKSTART, ["cluster.replica_heal_transport=process_group",
                                      "cluster.step_timeout_seconds=40",
                                      "cluster.replica_collective_timeout_seconds=7"])
    member = replica_membership(2, 1, "http://h:1", torchrun, **spec.replica_settings())
    assert member.heal_transport == "process_group"
    assert (member.timeout_seconds, member.quorum_timeout_seconds) == (20.0, 40.0)
    assert member.collective_timeout_seconds == 7.0
    with pytest.raises(JobSpecError, match=r"cluster.replica_heal_transport"):
        load_job_spec(QUICKSTART, ["cluster.replica_heal_transport=ftp"])
    with pytest.raises(ValueError, match=r"^cluster.replica_heal_transport: 'ftp' is not one "
                                         r"of http, process_group$"):
        ReplicaMembership(index=0, count=2, lighthouse="-", store=("-", 0),
                          heal_transport="ftp")


def test_each_group_runs_in_a_directory_of_its_own(tmp_path: Path) -> None:
    options = load_job_spec(QUICKSTART, [f"run_dir={tmp_path}"]).train_options()
    mine = group_run(options, 1)
    assert mine.run_dir == f"{tmp_path}/replica-1"
    assert mine.checkpoint_location == f"{tmp_path}/replica-1/checkpoints"
    shared = load_job_spec(QUICKSTART, [f"run_dir={tmp_path}",
                                        f"checkpoint.path={tmp_path}/ck"]).train_options()
    assert group_run(shared, 0).checkpoint_location == f"{tmp_path}/ck/replica-0"


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def test_two_torchrun_replica_groups_and_a_lighthouse_train_in_step(tmp_path: Path) -> None:
    """Two torchruns (one rank each) and a Lighthouse that waits for both: every step is
    committed by both groups together, and they log the same losses and gradient norms
    (each rank averages its gradients with the other group's, so both take the same step),
    each in its own run directory."""
    port = free_loopback_port()
    lighthouse = subprocess.Popen(
        [str(LIGHTHOUSE), "--min_replicas", "2", "--join_timeout_ms", "100",
         "--bind", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    sets = [f"run_dir={tmp_path / 'run'}", "parallel.cp=1", "parallel.dp_replicate=2",
            "train.steps=4", "train.seq_len=256", "train.precision=fp32",
            "checkpoint.interval=2", "eval.passkey_lengths=[]",
            "train.peak_tflops_per_device=1.0"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
    groups = []
    try:
        for index in range(2):
            groups.append(subprocess.Popen(
                [*TORCHRUN, "--master-addr", "127.0.0.1", "--master-port",
                 str(free_loopback_port()), "-m", "ringray.train", "--config", str(QUICKSTART),
                 "--replica-group", str(index), *[a for s in sets for a in ("--set", s)]],
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + 240
        outputs = []
        for group in groups:
            out, _ = group.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
            assert group.returncode == 0, out[-3000:]
    finally:
        for process in [*groups, lighthouse]:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    assert "replica group 0 of 2" in outputs[0] and "replica group 1 of 2" in outputs[1]
    logs = [_steps(tmp_path / "run" / f"replica-{index}") for index in range(2)]
    for log in logs:
        assert [line["step"] for line in log] == [1, 2, 3, 4]
        assert all(line["replicas_participating"] == [0, 1] and line["committed"]
                   for line in log), log
    assert [(a["loss"], a["grad_norm"]) for a in logs[0]] == [
        (b["loss"], b["grad_norm"]) for b in logs[1]]
    for index in range(2):
        assert (tmp_path / "run" / f"replica-{index}" / "checkpoints").is_dir()


class _Joined(Exception):
    pass


def test_torchrun_takes_the_collective_timeout_from_the_job_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the process group's timeout is the job file's (twice
    cluster.step_timeout_seconds, as on Ray), not a constant 10 minutes."""
    import torch.distributed as dist

    import ringray.train.__main__ as entry

    joined: list[float] = []

    def init_process_group(backend, *, timeout):
        joined.append(timeout.total_seconds())
        raise _Joined

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for step_timeout, want in ((None, 600.0), (7.5, 15.0)):
        args = ["--config", str(ROOT / "jobs" / "quickstart.yaml"),
                "--set", f"run_dir={tmp_path / 'run'}"]
        if step_timeout is not None:
            args += ["--set", f"cluster.step_timeout_seconds={step_timeout}"]
        with pytest.raises(_Joined):
            entry.main(args)
        assert joined.pop() == want
