"""Jobs on a remote Ray cluster through the Ray Jobs API: submit, list, inspect, follow, stop.

    client = RayJobs("http://head-node:8265")         # the Ray dashboard's address
    submission = client.submit(spec_path="jobs/quickstart.yaml", job_name="quickstart",
                               overrides=["train.steps=200"], run_dir="~/ringray-runs/q")
    client.info(submission).status                    # PENDING, RUNNING, SUCCEEDED, ...
    for chunk in client.follow_logs(submission): print(chunk, end="")
    client.stop(submission)

A submission runs ``ringray train SPEC --address auto`` on the cluster, with this directory
shipped as the job's working directory (the spec and any local data travel with it; the
virtual environment and runs do not). The cluster's nodes need ringray installed.

Stopping sends the driver SIGTERM, which ``ringray train`` handles like Ctrl-C: the job
checkpoints at its next step boundary and stops. The submission gives it
:data:`STOP_GRACE_SECONDS` before Ray kills the driver; the job's controller is detached, so
a stop already asked for completes even then.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ray.job_submission import JobSubmissionClient

# Metadata keys a ringray submission carries (how `list` tells ours apart, `resume` re-runs).
META_JOB = "ringray_job"
META_SPEC = "ringray_spec"
META_OVERRIDES = "ringray_overrides"
META_RUN_DIR = "ringray_run_dir"
# Seconds between SIGTERM and SIGKILL when a submission is stopped (Ray's default is 3 s,
# too little for a checkpoint of a large model).
STOP_GRACE_SECONDS = 120
# Left out of the uploaded working directory: environments, runs, caches, VCS data.
UPLOAD_EXCLUDES = [".venv", "venv", "runs", ".git", "__pycache__", ".pytest_cache",
                   ".ruff_cache", "*.egg-info"]
TERMINAL = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
# How long a submission waits for a freshly started cluster's job agent.
AGENT_WAIT_SECONDS = 60


@dataclass(frozen=True, kw_only=True)
class Submission:
    submission_id: str
    job_name: str  # the spec's name ("" for a submission that is not ringray's)
    status: str  # PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str
    entrypoint: str
    start_time: float | None  # Unix seconds
    end_time: float | None
    spec: str
    overrides: tuple[str, ...]
    run_dir: str

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def to_dict(self) -> dict:
        return {
            "submission_id": self.submission_id, "job_name": self.job_name,
            "status": self.status, "message": self.message, "entrypoint": self.entrypoint,
            "start_time": self.start_time, "end_time": self.end_time, "spec": self.spec,
            "overrides": list(self.overrides), "run_dir": self.run_dir,
        }


def train_entrypoint(spec_path: str, overrides: Sequence[str]) -> str:
    """The command a submission runs on the cluster."""
    parts = ["ringray", "train", spec_path, "--address", "auto"]
    for item in overrides:
        parts += ["--set", item]
    return shlex.join(parts)


class RayJobs:
    """The Ray Jobs API of one cluster (its dashboard address, ``http://host:8265``)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._client = JobSubmissionClient(address)

    def submit(self, *, spec_path: str, job_name: str, overrides: Sequence[str],
               run_dir: str, working_dir: str = ".") -> str:
        """Start ``ringray train`` on the cluster; returns the submission id."""
        overrides = [o for o in overrides if not o.startswith("run_dir=")]
        overrides.append(f"run_dir={run_dir}")
        submission_id = f"ringray-{job_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        deadline = time.monotonic() + AGENT_WAIT_SECONDS
        while True:
            try:
                return self._submit_once(submission_id, spec_path, overrides, run_dir,
                                         job_name, working_dir)
            except RuntimeError as exc:
                # A cluster that has just started answers before its job agent is up.
                if "No available agent" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(2)

    def _submit_once(self, submission_id: str, spec_path: str, overrides: list[str],
                     run_dir: str, job_name: str, working_dir: str) -> str:
        return self._client.submit_job(
            entrypoint=train_entrypoint(spec_path, overrides),
            submission_id=submission_id,
            runtime_env={
                "working_dir": working_dir,
                "excludes": UPLOAD_EXCLUDES,
                "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_SECONDS)},
            },
            metadata={META_JOB: job_name, META_SPEC: spec_path,
                      META_OVERRIDES: "\n".join(overrides), META_RUN_DIR: run_dir},
        )

    def info(self, submission_id: str) -> Submission:
        return _submission(self._client.get_job_info(submission_id))

    def list(self) -> list[Submission]:
        """ringray's submissions, newest first."""
        ours = [_submission(job) for job in self._client.list_jobs()
                if (job.metadata or {}).get(META_JOB)]
        return sorted(ours, key=lambda s: s.start_time or 0, reverse=True)

    def logs(self, submission_id: str) -> str:
        return self._client.get_job_logs(submission_id)

    def follow_logs(self, submission_id: str) -> Iterator[str]:
        """The job's output as it is written, until the job ends."""
        stream = self._client.tail_job_logs(submission_id)
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(stream.aclose())
            loop.close()

    def stop(self, submission_id: str) -> bool:
        """Ask the job to stop (it checkpoints first); False if it had already ended."""
        return self._client.stop_job(submission_id)


def _submission(job) -> Submission:
    meta = job.metadata or {}
    status = job.status.value if hasattr(job.status, "value") else str(job.status)
    return Submission(
        submission_id=job.submission_id or job.job_id or "",
        job_name=meta.get(META_JOB, ""),
        status=status,
        message=job.message or "",
        entrypoint=job.entrypoint,
        start_time=job.start_time / 1000 if job.start_time else None,
        end_time=job.end_time / 1000 if job.end_time else None,
        spec=meta.get(META_SPEC, ""),
        overrides=tuple(line for line in meta.get(META_OVERRIDES, "").split("\n") if line),
        run_dir=meta.get(META_RUN_DIR, ""),
    )
