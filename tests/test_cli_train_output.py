"""What `ringray train` prints when its output is not a terminal (a file, CI's log): the
driver's own lines, the controller's events and the live line's last state, each once and
whole. The driver runs as `ringray train` runs it, with Ray's side (connect, the controller,
its status) stood in for, so no Ray starts."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest
from rich.console import Console

import ringray.cli.train as train_cli
import ringray.cluster.driver as driver
from ringray.cluster.record import passkey_summary
from ringray.cluster.status import Event, JobStatus
from ringray.data import PasskeyReport
from ringray.data.passkey import PasskeyCell
from ringray.spec import load_job_spec
from ringray.train import StepStats

ROOT = Path(__file__).resolve().parent.parent
URL = "http://127.0.0.1:9477/metrics"


def _stats(step: int) -> StepStats:
    return StepStats(step=step, loss=1.6538, grad_norm=2.3, learning_rate=1e-5,
                     step_seconds=19.7, tokens=2048, tokens_per_second=104.0,
                     attention_compute_seconds=[1.0, 1.0], exposed_comm_seconds=[0.0, 0.0],
                     overlap_ratio=1.0, load_imbalance=1.0, mfu=None, peak_memory_bytes=1,
                     peer_wait_seconds_max=0.149)


def _status(state: str, step: int, events: tuple[Event, ...]) -> JobStatus:
    return JobStatus(job_name="out", state=state, step=step, total_steps=4, dp=1, target_dp=1,
                     cp=2, restarts=(), failures_used=0, resizes=0,
                     last_stats=_stats(step) if step else None, last_checkpoint_step=None,
                     workers=(), plan=None, error=None, events=events, metrics_url=URL)


@pytest.fixture
def piped(monkeypatch, tmp_path: Path) -> io.StringIO:
    """`ringray train`'s stderr console writing to a file-like (not a terminal), and Ray's
    side of the driver stood in for: a controller whose first event is its metrics
    endpoint, then the job's steps, then its end."""
    out = io.StringIO()
    monkeypatch.setattr(train_cli, "err", Console(file=out))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # _run_on_ray sets it when unset
    events = (Event(time=1.0, state="placing", message=f"metrics: {URL}"),
              Event(time=2.0, state="starting", message="state: starting"),
              Event(time=3.0, state="running", message="started 2 workers (dp=1 × cp=2) at "
                                                       "step 0"))
    final = _status("finished", 4, events)
    monkeypatch.setattr(driver, "connect", lambda address, *, local_cpus: True)
    monkeypatch.setattr(driver, "start_controller", lambda job: (object(), False))
    monkeypatch.setattr(driver, "job_status", lambda controller: final)
    monkeypatch.setattr(driver, "release", lambda controller: None)

    def follow(controller, *, on_status, **kwargs) -> JobStatus:
        for step in range(5):
            on_status(_status("running", step, events))
        on_status(final)
        return final

    monkeypatch.setattr(driver, "follow", follow)
    return out


def _run(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()  # the controller's, which writes job.yaml there
    spec = load_job_spec(ROOT / "jobs/quickstart.yaml",
                         ["name=out", f"run_dir={tmp_path / 'run'}", "parallel.cp=2",
                          "train.steps=4"])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        train_cli._run_on_ray(spec, spec.job_options(), address=None)
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_the_metrics_line_is_printed_once(piped: io.StringIO, tmp_path: Path) -> None:
    """The driver prints the controller's Prometheus endpoint (with where the dashboards
    are); the controller's own event naming it is not printed a second time (it was:
    `metrics: URL (Prometheus; ...)`, then `  metrics: URL`)."""
    _run(tmp_path)
    text = piped.getvalue()
    assert text.count(URL) == 1, text
    assert f"metrics: {URL} (Prometheus; dashboards in dashboards/)" in text
    assert "  started 2 workers (dp=1 × cp=2) at step 0" in text  # other events still are


def test_the_last_live_line_is_whole_when_not_a_terminal(piped: io.StringIO,
                                                         tmp_path: Path) -> None:
    """Piped to a file, the live line's last state is printed once and in full, however
    long (rich cut its last frame at 80 columns: `finis… loss 1.6538 ... imbalance 1.…`)."""
    _run(tmp_path)
    lines = piped.getvalue().splitlines()
    full = train_cli.format_status_line(_status("finished", 4, ()))
    assert len(f"finished 4/4 {full}") > 80  # longer than rich's width for a file
    last = [line for line in lines if full in line]
    assert last == [f"{'finished':<13} 4/4  {full}"], lines
    assert not any("…" in line for line in lines), lines


def test_a_terminal_still_gets_the_live_bar() -> None:
    """On a terminal the live view is rich's progress bar, redrawn in place, as before."""
    out = io.StringIO()
    view = train_cli._TrainView(4, console=Console(file=out, force_terminal=True, width=200))
    assert view.live
    with view:
        view.update(_status("running", 2, ()))
    assert "━" in out.getvalue() and "2/4" in out.getvalue()


def test_the_passkey_event_leads_with_exact_match() -> None:
    """The run's passkey line says how many prompts the model answered exactly (what shows
    a model retrieving), per length, then per digit against chance."""
    cells = (PasskeyCell(length=4096, depth=0.1, samples=2, exact_matches=2, digits_correct=10,
                         digits_total=10),
             PasskeyCell(length=4096, depth=0.9, samples=2, exact_matches=1, digits_correct=8,
                         digits_total=10),
             PasskeyCell(length=8192, depth=0.1, samples=2, exact_matches=0, digits_correct=2,
                         digits_total=10),
             PasskeyCell(length=8192, depth=0.9, samples=2, exact_matches=0, digits_correct=1,
                         digits_total=10))
    report = PasskeyReport(lengths=(4096, 8192), depths=(0.1, 0.9), samples_per_cell=2,
                           digits=5, seed=0, cells=cells)
    assert passkey_summary(report) == (
        "passkey: exact match 0.38 (3/8 prompts; 4096: 0.75, 8192: 0.00), per-digit accuracy "
        "0.525 (chance: exact 1e-05, per digit 0.1)")


def test_the_live_line_counts_a_lost_replica_groups_workers_out_until_it_heals() -> None:
    """Two replica groups of one rank; group 1 lost at step 2. The line read "world 2/2 …
    replicas 1/2" while only group 0's worker held the job: it now reads "world 1/2" until
    the replacement heals, and a loss before a restart counts no more once the job has
    restarted (the restart started every group)."""
    from dataclasses import replace

    from ringray.cluster.status import ReplicaLoss, Restart

    lost = ReplicaLoss(group=1, reason="node_died", at_step=2)
    base = replace(_status("running", 3, ()), dp=2, target_dp=1, cp=1, replica_groups=2,
                   last_stats=replace(_stats(3), replicas_participating=[0]))
    line = train_cli.format_status_line(replace(base, replica_losses=(lost,)))
    assert "world 1/2" in line and "replicas 1/2 (lost 1)" in line, line
    healed = replace(lost, healed_at_step=3, heal_seconds=0.4)
    assert "world 2/2" in train_cli.format_status_line(replace(base, replica_losses=(healed,)))
    restart = Restart(reason="node_died", detail="-", detected_at=0.0, failed_at_step=2)
    line = train_cli.format_status_line(replace(base, replica_losses=(lost,),
                                                restarts=(restart,)))
    assert "world 2/2" in line, line
