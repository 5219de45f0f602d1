"""The job controller: one Ray actor per job that places, starts, drives and heals its workers.

    controller, _ = start_controller(job_options)   # see ringray.cluster.driver
    controller.status.remote()       # a JobStatus, any time
    controller.stop.remote()         # checkpoint where possible, then stop (in any state)

The actor is a thin shell. It writes the run directory (through the record's
:class:`~ringray.train.run_dir.RunDirectory`: the lock, kept fresh by its heartbeat for the
job's whole life, ``steps.jsonl``, ``passkey.json``), serves
the job's metrics, and runs the state machine (:mod:`ringray.cluster.machine`) on a thread of
its own, so the job goes on without its caller: the actor is detached and named after the
job, and a new ``ringray train`` reattaches. The machine's states are values
(:mod:`ringray.cluster.states`)::

    Placing ─► Starting ─► Running ⇄ Checkpointing(then) ─► Evaluating ─► Finished
       ▲          │          │              │
       │          ▼          ▼              ▼
       └────── Recovering(failure) ◄────────┘        (also Resizing(to_dp); Failed; Stopped)

What it does to the workers goes through :class:`~ringray.cluster.worker_group.RayWorkerGroup`
(each worker holds a :class:`~ringray.train.session.TrainingSession`), what it
records through :class:`~ringray.cluster.record.JobRecord` (``events.jsonl`` keeps every
error's traceback).
"""

from __future__ import annotations

import threading
from pathlib import Path

from ringray.cluster.job_options import JobOptions
from ringray.cluster.machine import JobMachine
from ringray.cluster.record import JobRecord
from ringray.cluster.replica_groups import ReplicatedWorkerGroup
from ringray.cluster.states import Failed, Placing, State
from ringray.cluster.status import JobState, JobStatus
from ringray.cluster.worker_group import RayWorkerGroup
from ringray.metrics.exporter import JobMetrics
from ringray.train.run_lock import RunDirInUse


class JobController:
    """The actor class; :func:`ringray.cluster.driver.start_controller` creates it."""

    def __init__(self, job: JobOptions) -> None:
        self.job = job
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.record = JobRecord(job, Path(job.train.run_dir), metrics=JobMetrics(job.name))
        self.record.hold_events()  # written once the run directory is this job's
        self.record.metrics_url = self._serve_metrics()
        # Replica groups (parallel.dp_replicate > 1) replace a lost group alone.
        group = ReplicatedWorkerGroup if job.replicas > 1 else RayWorkerGroup
        self.workers = group(job, self.record, should_stop=self._stop_requested.is_set)
        self.machine = JobMachine(job, self.workers, self.record,
                                  stop_requested=self._stop_requested.is_set)

    def _serve_metrics(self) -> str | None:
        metrics = self.job.metrics
        if metrics.port is None:
            return None
        try:
            url = self.record.metrics.serve(metrics.address, metrics.port)
        except OSError as exc:  # training matters more than its dashboard: go on without
            self.record.event(f"metrics: cannot serve on {metrics.address}:{metrics.port} "
                              f"({exc.strerror}); set metrics.port to a free port (0: any)",
                              exc=exc)
            return None
        self.record.event(f"metrics: {url}")
        return url

    # ----------------------------------------------------------------- actor API
    def start(self) -> None:
        """Start the state machine (once; later calls do nothing)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="ringray-job",
                                                daemon=True)
                self._thread.start()

    def stop(self) -> str:
        """Checkpoint where possible, then stop; honoured in every state. Returns the state
        the job was in when the request arrived (what the stop will do depends on it)."""
        self._stop_requested.set()
        return self.record.status().state

    def status(self) -> JobStatus:
        return self.record.status()

    def job_options(self) -> JobOptions:
        """The job this controller runs (a reattaching ``ringray train`` compares its own)."""
        return self.job

    def wait(self, timeout_seconds: float) -> JobStatus:
        """The status once the job has ended, or after ``timeout_seconds``."""
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        return self.status()

    # ----------------------------------------------------------------- the machine
    def _main(self) -> None:
        try:
            note = self.record.open_run_dir()
        except RunDirInUse as exc:  # recorded in the status only: the directory is another's
            self.record.state(JobState.FAILED, error=str(exc))
            self.record.event(str(exc))
            return
        if note:
            self.record.event(note)
        state: State = Placing()
        try:
            while not state.terminal:
                self.record.state(state.name)
                state = self.machine.step(state)
        except Exception as exc:  # a controller bug: report it rather than leave a job hanging
            error = f"controller error: {type(exc).__name__}: {exc}"
            self.record.event(error, exc=exc)
            state = Failed(error=error)
            try:
                self.workers.teardown()
            except Exception as teardown_exc:
                self.record.event(f"teardown after the controller error failed: "
                                  f"{teardown_exc}", exc=teardown_exc)
        finally:
            try:
                self.workers.withdraw_request()
                self.workers.close()  # what outlives the workers (a Lighthouse)
            except Exception as exc:  # the job has ended either way
                self.record.event(f"withdrawing the autoscaler request failed: {exc}", exc=exc)
            self.record.run_dir.close()
        error = state.error if isinstance(state, Failed) else None
        if error:
            self.record.event(error)
        self.record.state(state.name, error=error)
