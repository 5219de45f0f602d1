"""Jobs on a Ray cluster through the CLI, end to end: `ray start --head` in a temporary
directory, then `ringray submit` runs a job to completion, `status` shows it, `logs --follow`
streams it, a second submission is stopped with `ringray stop` (it checkpoints first), and
`ringray resume` continues that run from its last checkpoint. The cluster is stopped
afterwards by killing only the processes of its temporary directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from distributed import free_loopback_port
from progress import prompt
from ray_cluster import stop_processes_under

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RINGRAY = str(BIN / "ringray")


def _start_head(temp_dir: str) -> str:
    """`ray start --head` on free ports (tried twice: a port picked free may be taken by
    the time Ray binds it); the dashboard's URL."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    for _attempt in range(2):
        port, dashboard_port = free_loopback_port(), free_loopback_port()
        started = subprocess.run(
            [str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=4",
             f"--temp-dir={temp_dir}", "--include-dashboard=true",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
             "--disable-usage-stats"],
            env=env, capture_output=True, text=True, timeout=180,
        )
        if started.returncode == 0:
            return f"http://127.0.0.1:{dashboard_port}"
        stop_processes_under(temp_dir)
    raise AssertionError(f"ray start failed twice:\n{started.stdout[-2000:]}\n"
                         f"{started.stderr[-3000:]}")


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head node with its dashboard (the Jobs API) on free loopback ports, shared by
    this module's tests."""
    temp_dir = tempfile.mkdtemp(prefix="rr-jobs-", dir="/tmp")
    try:
        url = _start_head(temp_dir)
        deadline = time.monotonic() + 90
        while True:  # the dashboard's job module comes up after `ray start` returns
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the Ray dashboard never answered"
                time.sleep(1)
        yield url
    finally:
        stop_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _ringray(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([RINGRAY, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


def _small(name: str) -> list[str]:
    return ["--set", f"name={name}", "--set", "train.seq_len=512", "--set", "parallel.cp=2",
            "--set", "checkpoint.interval=2", "--set", "eval.passkey_lengths=[]",
            "--set", "metrics.port=null"]


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_submit_status_logs_stop_and_resume(ray_head: str, tmp_path: Path) -> None:
    address = ["--address", ray_head]

    # A job runs to completion; `logs --follow` streams it until it ends.
    first_dir = tmp_path / "first"
    submitted = _ok(_ringray("submit", "jobs/quickstart.yaml", *address, "--steps", "4",
                             *_small("sub-first"), "--run-dir", str(first_dir), "--json"))
    first = json.loads(submitted.stdout)["submission_id"]
    followed = _ok(_ringray("logs", first, "--follow", *address))
    assert "job 'sub-first' finished at step 4/4" in followed.stdout
    assert f"{first}: SUCCEEDED" in followed.stderr
    status = json.loads(_ok(_ringray("status", first, *address, "--json")).stdout)
    assert status["status"] == "SUCCEEDED" and status["job_name"] == "sub-first"
    assert status["run_dir"] == str(first_dir)
    assert _steps(first_dir) == [1, 2, 3, 4]

    # A second one is stopped: it checkpoints the step it reached, then stops.
    second_dir = tmp_path / "second"
    second = _ok(_ringray("submit", "jobs/quickstart.yaml", *address, "--steps", "100000",
                          *_small("sub-second"), "--run-dir", str(second_dir))).stdout.strip()
    deadline = time.monotonic() + 180
    while len(_steps(second_dir)) < 3:
        assert time.monotonic() < deadline, _ringray("logs", second, *address).stdout[-3000:]
        time.sleep(0.5)
    stopped = _ok(_ringray("stop", second, *address))
    assert f"{second}: STOPPED" in stopped.stderr
    reached = _steps(second_dir)[-1]
    assert list((second_dir / "checkpoints").glob(f"step_{reached:08d}-*"))
    assert "stopping: checkpoint at the next step boundary" in _ringray(
        "logs", second, *address).stdout

    # Checked here before anything is sent (both were submitted, then failed on the
    # cluster): an override that does not hold, and a directory without the job's spec.
    bad = _ringray("resume", second, *address, "--set", "parallel.cp=3")
    assert bad.returncode == 2 and "error: train.seq_len: 512 cannot be split" in bad.stderr
    elsewhere = subprocess.run([RINGRAY, "resume", second, *address], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode == 2, elsewhere.stderr
    assert "error: jobs/quickstart.yaml: not in this directory" in elsewhere.stderr
    assert "submitted from" in " ".join(elsewhere.stderr.split())

    # `resume` submits it again; it continues from that checkpoint.
    resumed = _ok(_ringray("resume", second, *address, "--steps", str(reached + 2)))
    third = resumed.stdout.strip()
    followed = _ok(_ringray("logs", third, "--follow", *address))
    assert f"at step {reached}, restored" in followed.stdout
    assert f"finished at step {reached + 2}/{reached + 2}" in followed.stdout
    assert _steps(second_dir) == list(range(1, reached + 3))

    table = _ok(_ringray("list", *address)).stdout  # a pipe: 80 columns cut the ids before
    assert first in table and second in table and third in table
    listed = json.loads(_ok(_ringray("list", *address, "--json")).stdout)
    statuses = {s["submission_id"]: s["status"] for s in listed}
    assert {first: "SUCCEEDED", second: "STOPPED", third: "SUCCEEDED"}.items() <= \
        statuses.items()


@pytest.mark.slow
def test_stop_while_waiting_for_capacity_stops_within_seconds(ray_head: str,
                                                              tmp_path: Path) -> None:
    """A job whose workers need a resource no node has waits for capacity (up to 300 s);
    `ringray stop` ends it within seconds, STOPPED, saying where it was."""
    address = ["--address", ray_head]
    run_dir = tmp_path / "waiting"
    submitted = _ok(_ringray(
        "submit", "jobs/quickstart.yaml", *address, "--steps", "4", *_small("sub-waiting"),
        "--set", "cluster.worker_resources={CPU: 1, nowhere: 1}",
        "--set", "cluster.capacity_wait_seconds=300", "--run-dir", str(run_dir)))
    job = submitted.stdout.strip()
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + prompt(120)  # stretched by the load beyond the cores
    while not (events.exists() and "waiting for capacity" in events.read_text()):
        assert time.monotonic() < deadline, _ringray("logs", job, *address).stdout[-3000:]
        time.sleep(0.5)
    asked, allowed = time.monotonic(), prompt(30)
    stopped = _ok(_ringray("stop", job, *address))
    assert time.monotonic() - asked < allowed
    assert f"{job}: STOPPED" in stopped.stderr
    assert "stopped before the job was placed" in events.read_text()


def test_job_commands_fail_in_one_line(ray_head: str) -> None:
    unknown = _ringray("status", "no-such-job", "--address", ray_head)
    assert unknown.returncode == 2 and "no-such-job" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    unreachable = _ringray("list", "--address", f"http://127.0.0.1:{free_loopback_port()}")
    assert unreachable.returncode == 2 and "--address" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr
    bad_spec = _ringray("submit", "jobs/quickstart.yaml", "--address", ray_head,
                        "--set", "parallel.cp=3")
    assert bad_spec.returncode == 2 and "train.seq_len" in bad_spec.stderr
