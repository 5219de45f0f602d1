"""Jobs on a remote Ray cluster through the Ray Jobs API: submit, list, inspect, follow, stop.

    request = submission_request(spec_path="jobs/quickstart.yaml", job_name="quickstart",
                                 overrides=["train.steps=200"], run_dir="~/ringray-runs/q")
    request.to_dict()                                 # what would be sent (--dry-run)
    client = RayJobs("http://head-node:8265")         # the Ray dashboard's address
    submission = client.submit(request)
    client.info(submission).status                    # PENDING, RUNNING, SUCCEEDED, ...
    for chunk in client.follow_logs(submission): print(chunk, end="")
    client.stop(submission)

A submission runs ``python -m ringray train SPEC --address auto`` on the cluster: the
cluster's own Python, so no console script has to be on its PATH. This directory is shipped
as the job's working directory (the spec, any local data and, in a checkout, ringray's own
source travel with it; virtual environments and runs do not); where ringray's package is not
inside it, the package is shipped as well (``py_modules``). The runtime environment's ``pip``
brings ringray's dependencies that a Ray image may lack (:func:`job_requirements`: those of
ringray's pyproject.toml except torch, triton and Ray, which the cluster must bring itself,
in versions that match its drivers and its Ray). What a cluster needs is therefore Ray and
torch, and a ``python`` on its PATH; with ``pip=False`` (``--no-pip``) it needs ringray's
dependencies as well.

Stopping sends the driver SIGTERM, which ``ringray train`` handles like Ctrl-C: the job
checkpoints at its next step boundary and stops. The submission gives it
:data:`STOP_GRACE_SECONDS` before Ray kills the driver; the job's controller is detached, so
a stop already asked for completes even then.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import ringray

# Metadata keys a ringray submission carries (how `list` tells ours apart, `resume` re-runs).
META_JOB = "ringray_job"
META_SPEC = "ringray_spec"
META_OVERRIDES = "ringray_overrides"
META_RUN_DIR = "ringray_run_dir"
META_PIP = "ringray_pip"  # the packages the runtime env's pip installed, one a line
# Seconds between SIGTERM and SIGKILL when a submission is stopped (Ray's default is 3 s,
# too little for a checkpoint of a large model).
STOP_GRACE_SECONDS = 120
# Left out of the uploaded working directory: environments, runs, caches, VCS data.
UPLOAD_EXCLUDES = [".venv*", "venv", "runs", ".git", "__pycache__", ".pytest_cache",
                   ".ruff_cache", "*.egg-info"]
TERMINAL = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
# How long a submission waits for a freshly started cluster's job agent.
AGENT_WAIT_SECONDS = 180
# Never installed by a job: the cluster's own builds (CUDA, drivers, the running Ray) rule.
CLUSTER_PROVIDED = frozenset({"torch", "triton", "ray"})


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
    pip: tuple[str, ...] | None = None  # None: a submission from before pip was recorded

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def to_dict(self) -> dict:
        return {
            "submission_id": self.submission_id, "job_name": self.job_name,
            "status": self.status, "message": self.message, "entrypoint": self.entrypoint,
            "start_time": self.start_time, "end_time": self.end_time, "spec": self.spec,
            "overrides": list(self.overrides), "run_dir": self.run_dir,
            "pip": None if self.pip is None else list(self.pip),
        }


@dataclass(frozen=True, kw_only=True)
class SubmissionRequest:
    """Everything a submission sends to the Jobs API, built without Ray (``--dry-run`` prints
    :meth:`to_dict`)."""

    submission_id: str
    entrypoint: str
    runtime_env: dict
    metadata: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"submission_id": self.submission_id, "entrypoint": self.entrypoint,
                "runtime_env": self.runtime_env, "metadata": self.metadata}


def train_entrypoint(spec_path: str, overrides: Sequence[str]) -> str:
    """The command a submission runs on the cluster: ringray as a module of the cluster's
    Python (its PATH need not hold ringray's console script)."""
    parts = ["python", "-m", "ringray", "train", spec_path, "--address", "auto"]
    for item in overrides:
        parts += ["--set", item]
    return shlex.join(parts)


def requirement_name(requirement: str) -> str:
    """A requirement's project name, normalised as PyPI does (``Prometheus_Client>=1`` ->
    ``prometheus-client``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"requirement {requirement!r}: no project name")
    return re.sub(r"[-_.]+", "-", match[1]).lower()


def job_requirements() -> list[str]:
    """ringray's runtime dependencies that a job installs on a cluster: every requirement of
    ringray's ``[project] dependencies`` (markers kept) except torch, triton and Ray.

    Read from the checkout's pyproject.toml when ringray runs from one (an installed
    checkout's metadata lags behind an edit until it is reinstalled), else from the installed
    distribution's metadata.
    """
    import tomllib

    pyproject = Path(ringray.__file__).resolve().parents[1] / "pyproject.toml"
    project = {}
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    if project.get("name") == "ringray":
        requirements = list(project.get("dependencies", []))
    else:
        try:
            declared = metadata.requires("ringray") or []
        except metadata.PackageNotFoundError:  # neither a checkout nor installed: none known
            declared = []
        requirements = [r for r in declared if not re.search(r"\bextra\s*==", r)]
    return [r for r in requirements if requirement_name(r) not in CLUSTER_PROVIDED]


def runtime_env(*, working_dir: str, pip: Sequence[str]) -> dict:
    """The job's runtime environment: the working directory (with ringray's package added as
    a ``py_modules`` entry when it is not the checkout's ``ringray/`` there), the stop grace
    period, and ``pip`` packages when there are any."""
    env: dict = {
        "working_dir": working_dir,
        "excludes": list(UPLOAD_EXCLUDES),
        "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_SECONDS)},
    }
    package = Path(ringray.__file__).resolve().parent
    if package != Path(working_dir).resolve() / "ringray":
        env["py_modules"] = [str(package)]
    if pip:
        # Ray's pip step installs into a virtualenv of its own that sees the cluster's
        # packages, so what is already there (numpy, pyyaml, ...) is not installed again.
        env["pip"] = {"packages": list(pip), "pip_check": False}
    return env


def submission_request(*, spec_path: str, job_name: str, overrides: Sequence[str],
                       run_dir: str, working_dir: str = ".", pip: Sequence[str] | None = None,
                       submission_id: str | None = None) -> SubmissionRequest:
    """What submitting ``spec_path`` sends: entrypoint, runtime environment and metadata.

    ``pip`` is the runtime env's package list; ``None`` means ringray's
    :func:`job_requirements`. The run directory replaces any ``run_dir=`` override.
    """
    overrides = [o for o in overrides if not o.startswith("run_dir=")]
    # A JSON string is a YAML string: '~', 'null', '#x' or '123' stay the path they are.
    overrides.append(f"run_dir={json.dumps(run_dir)}")
    packages = job_requirements() if pip is None else list(pip)
    return SubmissionRequest(
        submission_id=submission_id or f"ringray-{job_name}-{time.strftime('%Y%m%d-%H%M%S')}",
        entrypoint=train_entrypoint(spec_path, overrides),
        runtime_env=runtime_env(working_dir=working_dir, pip=packages),
        metadata={META_JOB: job_name, META_SPEC: spec_path,
                  META_OVERRIDES: "\n".join(overrides), META_RUN_DIR: run_dir,
                  META_PIP: "\n".join(packages)},
    )


class RayJobs:
    """The Ray Jobs API of one cluster (its dashboard address, ``http://host:8265``)."""

    def __init__(self, address: str) -> None:
        from ray.job_submission import JobSubmissionClient

        self.address = address
        self._client = JobSubmissionClient(address)

    def submit(self, request: SubmissionRequest) -> str:
        """Start the request's job on the cluster; returns the submission id."""
        deadline = time.monotonic() + AGENT_WAIT_SECONDS
        while True:
            try:
                return self._client.submit_job(
                    entrypoint=request.entrypoint, submission_id=request.submission_id,
                    runtime_env=request.runtime_env, metadata=request.metadata)
            except RuntimeError as exc:
                # A cluster that has just started answers before its job agent is up.
                if "No available agent" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(2)

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
        pip=(tuple(line for line in meta[META_PIP].split("\n") if line)
             if META_PIP in meta else None),
    )
