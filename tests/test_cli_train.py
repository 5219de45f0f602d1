"""`ringray train SPEC` end to end on an embedded local Ray (the README's main job, shortened):
it trains, writes the run directory, resumes, and reports bad specs and impossible jobs in
one line with a non-zero exit code, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from progress import finish, prompt, run, wait_until

# A guard against hangs only: the waits below follow the run's progress, and the longest test
# takes 150 s on a quiet 2-core machine, several times that beside other heavy jobs.
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parent.parent
RINGRAY = str(Path(sys.executable).parent / "ringray")


def _train(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A command refused before it starts anything: ``timeout`` on a quiet machine."""
    return subprocess.run([RINGRAY, "train", "jobs/quickstart.yaml", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=prompt(timeout))


def _short_job(run_dir: Path) -> list[str]:
    return ["--steps", "4", "--set", "name=cli-test", "--set", f"run_dir={run_dir}",
            "--set", "train.seq_len=512", "--set", "parallel.cp=2",
            "--set", "checkpoint.interval=2", "--set", "eval.passkey_lengths=[512]",
            "--set", "eval.passkey_samples=1"]


def test_train_runs_a_job_to_the_end_and_resume_continues_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run([RINGRAY, "train", "jobs/quickstart.yaml", *_short_job(run_dir)], run_dir,
                cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "on an embedded local Ray" in first.stderr
    assert "job 'cli-test' finished at step 4/4" in first.stdout
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    states = [e["message"].removeprefix("state: ") for e in events
              if e["message"].startswith("state: ")]
    assert states[0] == "starting" and states[-2:] == ["evaluating", "finished"]
    assert (run_dir / "passkey.json").exists()
    assert sorted(p.name[:13] for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000004"]

    # `ringray resume RUN` trains the run's own job.yaml (the spec as run) again, from
    # wherever RUN is now: moved, it resumes from its own checkpoints and writes there (it
    # started at step 0 and wrote into the old place before).
    assert "run_dir: " + str(run_dir) in (run_dir / "job.yaml").read_text()
    moved = tmp_path / "moved"
    run_dir.rename(moved)
    below = subprocess.run([RINGRAY, "resume", str(moved), "--steps", "3"], cwd=ROOT,
                           capture_output=True, text=True, timeout=prompt(60))
    assert below.returncode == 2  # it reported "finished at step 4/3" before
    assert "train.steps: 3 is below step 4 of the checkpoint this run resumes" in below.stderr
    again = run([RINGRAY, "resume", str(moved), "--steps", "6"], moved, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished at step 6/6" in again.stdout
    events = [json.loads(line)["message"] for line in (moved / "events.jsonl").open()]
    started = [e for e in events if e.startswith("started ")]
    assert f"at step 4, restored {moved}/checkpoints/step_00000004-" in started[-1]
    assert not run_dir.exists()
    steps = [json.loads(line) for line in (moved / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    recorded = (moved / "job.yaml").read_text()  # the spec as resumed: where, how far
    assert f"run_dir: {moved}\n" in recorded and "  steps: 6\n" in recorded

    exported = subprocess.run([RINGRAY, "export", str(moved), "--hf", str(tmp_path / "hf")],
                              cwd=ROOT, capture_output=True, text=True, timeout=prompt(120))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "exported step 6" in exported.stdout
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--set", "parallel.cp=null"], "parallel.cp: required by `ringray train`"),
        (["--set", "cluster.dp_min=2"], "cluster.dp_min: 2 is larger than parallel.dp=1"),
        (["--set", "cluster.nodes=2"], "cluster.nodes: unknown field; valid: accelerator"),
    ],
)
def test_a_bad_spec_is_one_line(overrides: list[str], message: str) -> None:
    result = _train(*overrides)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_job_that_cannot_be_placed_fails_with_the_reason(tmp_path: Path) -> None:
    """Workers that each want a GPU, on an embedded Ray of this CPU-only machine: the job
    fails at once (nothing can join an embedded Ray), saying what is missing."""
    result = _train(*_short_job(tmp_path / "run"), "--set", "cluster.accelerator=gpu",
                    timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "job 'cli-test' failed at step 0: placement:" in result.stderr
    assert "worker slots" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_run_refused_after_its_checks_leaves_job_yaml_as_it_was(tmp_path: Path) -> None:
    """Two runs of one run directory started a moment apart both pass the check before Ray;
    the one whose controller does not get the lock is refused. It wrote its own steps and lr
    into job.yaml before, so `ringray resume` ran the loser's job. Here the test is the other
    run: it takes the lock once the command has passed its checks, before Ray is up."""
    from ringray.train.run_lock import RunLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text("the winner's spec\n")
    proc = subprocess.Popen([RINGRAY, "train", "jobs/quickstart.yaml", *_short_job(run_dir),
                             "--steps", "40", "--set", "train.optimizer.lr=0.5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    winner = RunLock(run_dir, job="winner")
    try:
        banner = proc.stderr.readline()  # printed once the checks before Ray have passed
        assert banner.startswith("ringray: job 'cli-test'"), banner + proc.stderr.read()
        winner.acquire()
        stdout, stderr = finish(proc, run_dir)
    finally:
        winner.release()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, stderr[-3000:]
    assert "is in use by job 'winner'" in stderr
    assert (run_dir / "job.yaml").read_text() == "the winner's spec\n"
    assert not (run_dir / "checkpoints").exists()


def test_ctrl_c_checkpoints_and_stops(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) while training: the job checkpoints at the next step boundary and
    stops; a second Ctrl-C cannot detach a job from an embedded Ray, and says so; the command
    exits 130 and the checkpoint is the last step done."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([RINGRAY, "train", "jobs/quickstart.yaml", *_short_job(run_dir),
                             "--steps", "100000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        steps_log = run_dir / "steps.jsonl"
        wait_until(lambda: steps_log.exists() and len(steps_log.read_text().splitlines()) >= 3,
                   proc, run_dir, "steps")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "stopping: checkpoint at the next step boundary, then stop" in stderr
    assert "still stopping: an embedded Ray cannot be detached" in stderr
    last = json.loads(steps_log.read_text().splitlines()[-1])["step"]
    assert f"job 'cli-test' stopped at step {last}/100000" in stdout
    assert list((run_dir / "checkpoints").glob(f"step_{last:08d}-*"))


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_like_ctrl_c(tmp_path: Path) -> None:
    """What `timeout` and systemd send: SIGTERM to every process of the command, Ray's own
    included. The job checkpoints and stops, the command exits promptly with 143 (128 +
    SIGTERM) after its final line, and the run directory's lock is gone. Before, Ray's
    processes died under the job: the driver hung 60 s, exited 1 without a final line, and
    the lock stayed."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([RINGRAY, "train", "jobs/quickstart.yaml", *_short_job(run_dir),
                             "--steps", "100000", "--set", "checkpoint.interval=1000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group, as `timeout` makes one
    try:
        steps_log = run_dir / "steps.jsonl"
        wait_until(lambda: steps_log.exists() and len(steps_log.read_text().splitlines()) >= 2,
                   proc, run_dir, "steps")
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = finish(proc, run_dir)
        took = time.monotonic() - sent
        allowed = prompt(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-3000:]
    assert "stopping: checkpoint at the next step boundary, then stop" in stderr
    last = json.loads(steps_log.read_text().splitlines()[-1])["step"]
    assert f"job 'cli-test' stopped at step {last}/100000" in stdout
    assert list((run_dir / "checkpoints").glob(f"step_{last:08d}-*"))
    assert not (run_dir / "ringray.lock").exists()
    assert took < allowed


@pytest.mark.slow
def test_ctrl_c_during_the_evaluation_ends_it_promptly(tmp_path: Path) -> None:
    """A long passkey evaluation (after the final checkpoint): Ctrl-C abandons it at once and
    says so, instead of promising a checkpoint at a step boundary that will not come."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([RINGRAY, "train", "jobs/quickstart.yaml", *_short_job(run_dir),
                             "--steps", "2", "--set", "eval.passkey_lengths=[4096]",
                             "--set", "eval.passkey_samples=200"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = run_dir / "events.jsonl"
    try:
        wait_until(lambda: events.exists() and "state: evaluating" in events.read_text(),
                   proc, run_dir, "evaluation")
        time.sleep(1.0)  # the CLI's view has seen the state
        asked = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = finish(proc, run_dir)
        took = time.monotonic() - asked
        allowed = prompt(20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "stopping: the passkey evaluation is abandoned" in stderr
    assert "stop requested during the passkey evaluation: abandoned" in stderr
    assert "job 'cli-test' stopped at step 2/2" in stdout
    assert took < allowed
    assert not (run_dir / "passkey.json").exists()


def test_stop_signals_while_the_controller_starts_wait_for_it() -> None:
    """Ctrl-C or SIGTERM while `ringray train` starts its controller raised out of the start
    (a traceback, and a job left without its stop); now they are held back and handed to the
    follow loop, which stops the job as for any other Ctrl-C."""
    from ringray.cli.train import _deferring_stop_signals

    def start() -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        return "controller"

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    result, came = _deferring_stop_signals(start)
    assert result == "controller"
    assert came == [signal.SIGTERM, signal.SIGINT]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
