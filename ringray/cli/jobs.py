"""``ringray submit | list | status | logs | stop | resume``: jobs on a remote Ray cluster.

    ringray submit jobs/quickstart.yaml --address http://head:8265     # prints the id
    ringray submit jobs/quickstart.yaml --dry-run     # prints what it would send (JSON)
    ringray list --address http://head:8265
    ringray status ringray-quickstart-20261121-101500 --address http://head:8265
    ringray logs ringray-quickstart-20261121-101500 --follow
    ringray stop ringray-quickstart-20261121-101500
    ringray resume ringray-quickstart-20261121-101500       # or: ringray resume runs/quickstart

``--address`` is the Ray dashboard's URL (the Ray Jobs API), and may come from
``$RAY_API_SERVER_ADDRESS`` as with Ray's own ``ray job`` commands.

A submission runs on the cluster's own Python (``python -m ringray``), and its runtime
environment's pip brings ringray's dependencies except torch, triton and Ray (``--no-pip``:
the image has them; ``--pip PKG``: more). ``--dry-run`` prints, as JSON, the submission id,
entrypoint, runtime environment and metadata that would be sent, and sends nothing.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ringray.cli.common import err, fail, first_line, load_run, load_spec
from ringray.cli.train import run_job

ADDRESS_HELP = ("Ray dashboard URL of the cluster (Ray Jobs API), e.g. http://head:8265; "
                "default: $RAY_API_SERVER_ADDRESS.")


def _address_option() -> str:
    return typer.Option(..., "--address", envvar="RAY_API_SERVER_ADDRESS", help=ADDRESS_HELP)


def _jobs(address: str, submission_id: str | None = None):
    """The cluster's Jobs API at ``address``; with ``submission_id``, that id checked first
    (an empty one or a path answered with the SDK's parsing errors)."""
    import logging

    if submission_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]*",
                                                      submission_id):
        fail(f"ID: {submission_id!r} is not a submission id (letters, digits, '.', '_', ':' "
             f"and '-', e.g. ringray-quickstart-20261121-101500; `ringray list` shows them)")
    if not address.startswith(("http://", "https://")):
        # Ray reads host:port as a GCS address and ray:// as a Ray Client one: either waits
        # 30-40 s and prints Ray's own warnings before it fails; the Jobs API is HTTP.
        fail(f"--address {address!r}: give the Ray dashboard's URL (the Jobs API), e.g. "
             f"http://head:8265")

    from ringray.cluster.jobs import RayJobs

    # Ray's SDK logs every packaging step at INFO; the commands say what matters themselves.
    logging.getLogger("ray").setLevel(logging.WARNING)
    try:
        return RayJobs(address)
    except Exception as exc:  # the SDK raises ConnectionError, ValueError, RuntimeError...
        fail(f"--address {address}: cannot reach the Ray Jobs API ({first_line(exc)})")


def _call(what: str, fn, *args):
    """A Jobs API call whose failure becomes one line (unknown id, lost connection)."""
    try:
        return fn(*args)
    except Exception as exc:
        fail(f"{what}: {first_line(exc)}")


def _say_when_nothing_resumes(spec, run: str) -> None:
    """A run whose checkpoint location holds no committed checkpoint (its only save crashed
    before its commit) trains again from step 0: said before it starts, not left to be
    noticed in the step counter."""
    from ringray.train.checkpoint import CheckpointStore

    location = spec.train_options().checkpoint_location
    try:
        store = CheckpointStore(location)
        if store.committed() or store.damaged():
            return
    except (OSError, ValueError):  # the run's own start reports the location's problem
        return
    err.print(f"warning: {location} holds no committed checkpoint (a save that did not "
              f"complete is not one); {run} trains again from step 0", highlight=False,
              soft_wrap=True)


def _check_pip(packages: list[str]) -> None:
    """Each ``--pip`` is a pip requirement, and none is one the cluster provides itself."""
    from packaging.requirements import InvalidRequirement, Requirement

    from ringray.cluster.jobs import CLUSTER_PROVIDED, requirement_name

    for package in packages:
        try:
            Requirement(package)
        except InvalidRequirement as exc:
            why = str(exc).splitlines()[0].rstrip(".") if str(exc).strip() else "unreadable"
            fail(f"--pip {package!r}: not a pip requirement ({why}); e.g. --pip flash-attn or "
                 f"--pip 'einops>=0.7'")
        if requirement_name(package) in CLUSTER_PROVIDED:
            fail(f"--pip {package!r}: the cluster's own (a job never installs "
                 f"{', '.join(sorted(CLUSTER_PROVIDED))}: they must match each other and the "
                 f"nodes' drivers); install it in the cluster's image")


def _short_message(message: str) -> str:
    """Ray's status message in one line: its first, without the copy of the logs that Ray
    appends to a failed entrypoint's (``status`` shows the last log line itself)."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return re.split(r",? last available logs", first)[0].rstrip(":, ")


def _when(seconds: float | None) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S") if seconds else "-"


def submit(
    spec_path: str = typer.Argument(..., metavar="SPEC", help="Job spec (YAML)."),
    address: str | None = typer.Option(
        None, "--address", envvar="RAY_API_SERVER_ADDRESS",
        help=ADDRESS_HELP + " Required unless --dry-run.",
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Override train.steps."),
    overrides: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--set", help="Override a spec field (repeatable), e.g. train.seq_len=8192."
    ),
    run_dir: str | None = typer.Option(
        None, "--run-dir",
        help="Run directory on the cluster (steps.jsonl, checkpoints); default: the spec's "
        "run_dir, else ~/ringray-runs/<name>. Multi-node jobs need shared storage there.",
    ),
    no_pip: bool = typer.Option(
        False, "--no-pip",
        help="Do not install ringray's dependencies on the cluster (its image has them).",
    ),
    pip: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--pip", metavar="PKG",
        help="Another package for the job's pip (repeatable), e.g. --pip flash-attn.",
    ),
    force: bool = typer.Option(
        False, "--force",
        help="Start even when a worker's planned memory exceeds what its node gives it "
        "(each worker checks on the cluster); submits --set train.memory_check=false.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run",
        help="Print the entrypoint, runtime environment and metadata it would send (JSON) "
        "and submit nothing.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the submission as JSON."),
) -> None:
    """Submit a job to a Ray cluster (Ray Jobs API); prints its submission id.

    The spec is validated here first. This directory is shipped as the job's working
    directory (without .venv, runs, .git); the cluster runs `python -m ringray train SPEC`
    with its own Python, which needs Ray and torch (of the versions the cluster runs). The
    job's pip installs ringray's other dependencies unless --no-pip; never torch, triton or
    Ray. On the cluster each worker refuses, before its session is built, a job that needs
    more memory than its node gives it (the submission then fails in one line, without
    retries); --force submits it with that check off.

    Example: ringray submit jobs/quickstart.yaml --address http://127.0.0.1:8265 --steps 50
    """
    from ringray.cluster.jobs import job_requirements, submission_request

    # Paths in the spec are the cluster's (run_dir, checkpoint.path): not checked here.
    spec = load_spec(spec_path, overrides, steps=steps, check_paths=False)
    overrides = [*overrides, f"train.steps={steps}"] if steps is not None else overrides
    if force:  # an override, so that `ringray resume ID` submits it the same way
        overrides = [*overrides, "train.memory_check=false"]
    if not Path(spec_path).resolve().is_relative_to(Path.cwd()):
        fail(f"{spec_path}: the spec must be inside this directory (it is shipped as the "
              f"job's working directory)")
    relative_spec = str(Path(spec_path).resolve().relative_to(Path.cwd()))
    if run_dir is not None and not (run_dir.startswith(("/", "~")) or "://" in run_dir):
        fail(f"--run-dir: {run_dir!r} is not an absolute path; the job runs in Ray's "
             f"temporary working directory, where a relative one would be lost; give e.g. "
             f"~/ringray-runs/{spec.name} or /shared/runs/{spec.name}")
    _check_pip(pip)
    run_dir = run_dir or spec.run_dir or f"~/ringray-runs/{spec.name}"
    packages = [*([] if no_pip else job_requirements()), *pip]
    request = submission_request(spec_path=relative_spec, job_name=spec.name,
                                 overrides=overrides, run_dir=run_dir,
                                 working_dir=str(Path.cwd()), pip=packages)
    if dry_run:
        json.dump(request.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        err.print("dry run: nothing was submitted", highlight=False)
        return
    if address is None:
        fail("--address (or $RAY_API_SERVER_ADDRESS): the Ray dashboard URL, e.g. "
             "http://head:8265, is required to submit")
    jobs = _jobs(address)
    submission_id = _call(f"--address {address}", lambda: jobs.submit(request))
    if as_json:
        json.dump({"submission_id": submission_id, "run_dir": run_dir}, sys.stdout)
        sys.stdout.write("\n")
        return
    err.print(f"submitted job {spec.name!r} to {address}; run directory on the cluster: "
               f"{run_dir}", highlight=False)
    err.print(f"follow it: ringray logs {submission_id} --follow --address {address}",
               highlight=False)
    print(submission_id)


def list_jobs(
    address: str = _address_option(),
    as_json: bool = typer.Option(False, "--json", help="Print the submissions as JSON."),
) -> None:
    """ringray's submissions on a cluster, newest first.

    Example: ringray list --address http://127.0.0.1:8265
    """
    jobs = _jobs(address)
    submissions = _call(f"--address {address}", jobs.list)
    if as_json:
        json.dump([s.to_dict() for s in submissions], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table()
    for column in ("submission", "job", "status", "started", "ended"):
        table.add_column(column, no_wrap=True)
    for s in submissions:
        table.add_row(s.submission_id, s.job_name, s.status, _when(s.start_time),
                      _when(s.end_time))
    # Never cut to the terminal's (or a pipe's 80) columns: the ids are what `status` takes.
    Console(width=max(Console().width, 240)).print(table)


def status(
    submission_id: str = typer.Argument(..., metavar="ID", help="Submission id."),
    address: str = _address_option(),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """A submission's state, times, run directory and latest progress line.

    Example: ringray status ringray-quickstart-20261121-101500 --address http://127.0.0.1:8265
    """
    jobs = _jobs(address, submission_id)
    info = _call(submission_id, jobs.info, submission_id)
    logs = _call(submission_id, jobs.logs, submission_id)
    progress = next((line.strip() for line in reversed(logs.splitlines()) if line.strip()), "")
    if as_json:
        json.dump({**info.to_dict(), "last_line": progress}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    # One line each, however long (an error line included); the cluster's text as it is.
    out = Console(soft_wrap=True, markup=False, highlight=False)
    message = _short_message(info.message)
    out.print(f"{info.submission_id}: {info.status}" + (f" ({message})" if message else ""))
    if info.job_name:
        out.print(f"  job {info.job_name!r}, spec {info.spec}, run directory {info.run_dir}")
    else:
        out.print("  not a ringray submission (no ringray metadata)")
    out.print(f"  started {_when(info.start_time)}, ended {_when(info.end_time)}")
    if progress:
        out.print(f"  last line: {progress}")


def logs(
    submission_id: str = typer.Argument(..., metavar="ID", help="Submission id."),
    address: str = _address_option(),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends."),
) -> None:
    """A submission's output (the `ringray train` progress and events).

    Example: ringray logs ringray-quickstart-20261121-101500 --follow
    """
    jobs = _jobs(address, submission_id)
    if not follow:
        sys.stdout.write(_call(submission_id, jobs.logs, submission_id))
        return
    _call(submission_id, jobs.info, submission_id)  # an unknown id fails in one line
    try:
        for chunk in jobs.follow_logs(submission_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None
    except Exception as exc:
        fail(f"{submission_id}: log stream ended ({first_line(exc)})")
    final = _call(submission_id, jobs.info, submission_id)
    err.print(f"{submission_id}: {final.status}", highlight=False)


def stop(
    submission_id: str = typer.Argument(..., metavar="ID", help="Submission id."),
    address: str = _address_option(),
    wait: bool = typer.Option(True, "--wait/--no-wait",
                              help="Wait until the job has checkpointed and stopped."),
) -> None:
    """Stop a submission: it checkpoints at its next step boundary, then stops.

    Example: ringray stop ringray-quickstart-20261121-101500 --address http://127.0.0.1:8265
    """
    from ringray.cluster.jobs import STOP_GRACE_SECONDS

    jobs = _jobs(address, submission_id)
    if not _call(submission_id, jobs.stop, submission_id):
        info = _call(submission_id, jobs.info, submission_id)
        err.print(f"{submission_id} had already ended: {info.status}", highlight=False)
        return
    err.print(f"{submission_id}: stop requested (checkpoint at the next step, then stop)",
               highlight=False)
    if not wait:
        return
    deadline = time.monotonic() + STOP_GRACE_SECONDS + 30
    with err.status("waiting for the job to stop..."):
        while not (info := _call(submission_id, jobs.info, submission_id)).done:
            if time.monotonic() > deadline:
                fail(f"{submission_id}: still {info.status} after {STOP_GRACE_SECONDS + 30} s")
            time.sleep(1)
    err.print(f"{submission_id}: {info.status}", highlight=False)


def resume(
    run: str = typer.Argument(..., metavar="RUN",
                              help="A run directory (with job.yaml) or a submission id."),
    address: str | None = typer.Option(
        None, "--address", envvar="RAY_API_SERVER_ADDRESS",
        help="For a submission id: the Ray dashboard URL, e.g. http://head:8265.",
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Override train.steps."),
    overrides: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--set", help="Override a spec field (repeatable)."
    ),
    force: bool = typer.Option(
        False, "--force",
        help="Start even when a worker's planned memory exceeds what its node gives it "
        "(train.memory_check: false; a submission id is resubmitted with that override).",
    ),
) -> None:
    """Continue a run from its last complete checkpoint after the whole job died.

    A run directory is trained again here, as `ringray train` would train its job.yaml (on an
    embedded Ray or $RAY_ADDRESS), from wherever the directory is now: a moved run directory
    resumes from its own checkpoints and writes there (run_dir is RUN, and a checkpoint.path
    inside the recorded run_dir is taken at the same place inside RUN; a checkpoint location
    elsewhere, such as s3://, is used as recorded). A submission id is submitted again, with
    the same spec, overrides and run directory.

    Example: ringray resume runs/quickstart --steps 200
    """
    from ringray.cluster.jobs import submission_request

    overrides = [*overrides, "checkpoint.resume=true"]
    if not run.strip():  # Path("") is the current directory
        fail("RUN: empty; give a run directory (e.g. runs/quickstart) or a submission id")
    if Path(run).expanduser().is_dir():
        spec = load_run(run, overrides, steps=steps)
        _say_when_nothing_resumes(spec, run)
        run_job(spec, address=None, force=force)
        return
    if address is None:
        fail(f"{run}: not a run directory; for a submission id give --address (the Ray "
              f"dashboard URL)")
    jobs = _jobs(address, run)
    info = _call(run, jobs.info, run)
    if not info.job_name:
        fail(f"{run}: not a ringray submission (no ringray metadata)")
    if not info.done:
        fail(f"{run}: still {info.status}; stop it first (ringray stop {run})")
    previous = [o for o in info.overrides if not o.startswith("train.steps=") or steps is None]
    if steps is not None:
        previous.append(f"train.steps={steps}")
    # The same spec, overrides, run directory and pip packages (the same environment).
    if force:
        overrides.append("train.memory_check=false")
    # This directory is shipped again as the job's working directory: its spec must be the
    # one submitted, and the overrides must hold, as `submit` checks before sending.
    if not (Path.cwd() / info.spec).is_file():
        fail(f"{info.spec}: not in this directory ({Path.cwd()}); resume {run} from the "
             f"directory it was submitted from, which is shipped again as its working directory")
    load_spec(info.spec, [o for o in [*previous, *overrides] if not o.startswith("run_dir=")],
              steps=None, check_paths=False)
    request = submission_request(spec_path=info.spec, job_name=info.job_name,
                                 overrides=[*previous, *overrides], run_dir=info.run_dir,
                                 working_dir=str(Path.cwd()), pip=info.pip)
    submission_id = _call(f"--address {address}", lambda: jobs.submit(request))
    err.print(f"resubmitted job {info.job_name!r} (from {run}) to continue from its last "
               f"checkpoint in {info.run_dir}", highlight=False)
    print(submission_id)
