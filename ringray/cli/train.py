"""``ringray train SPEC``: run a job on Ray (embedded or a cluster) and follow it."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from ringray.cli.common import err, fail, load_spec

if TYPE_CHECKING:  # torch and Ray are imported when the command runs, not for --help
    from ringray.cluster.job_options import JobOptions
    from ringray.spec import JobSpec

T = TypeVar("T")


def train(
    spec_path: str = typer.Argument(
        ..., metavar="SPEC", help="Job spec (YAML), e.g. jobs/quickstart.yaml."
    ),
    address: str | None = typer.Option(
        None, "--address",
        help="Ray cluster to run on ('auto', host:port, ray://...); default: $RAY_ADDRESS, "
        "else an embedded local Ray that ends with the command.",
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Override train.steps."),
    overrides: list[str] = typer.Option(  # noqa: B008 - typer's documented form
        [], "--set", help="Override a spec field (repeatable), e.g. train.seq_len=8192."
    ),
    force: bool = typer.Option(
        False, "--force",
        help="Start even when a worker's planned memory exceeds what its node gives it "
        "(checked before an embedded Ray starts, and on each worker's node before its "
        "session is built); sets train.memory_check: false.",
    ),
) -> None:
    """Run a job on Ray: place its rings, train, recover from failures, follow progress.

    Ctrl-C (or SIGTERM, as `timeout` and systemd send) checkpoints at the next step and
    stops; a second Ctrl-C detaches and leaves a job on a cluster running (`ringray train`
    with the same spec reattaches). Exit code: 0 finished, 2 refused or failed (one line),
    130 stopped by Ctrl-C, 143 by SIGTERM (128 + the signal, as shells report it).

    A job whose worker needs more memory than its node gives it (`ringray plan`'s model
    against the node's available RAM shared by the job's workers there, or a GPU's memory)
    is refused in one line: before an embedded Ray starts, and on a cluster by each worker
    before its session is built (the job fails, without retries); --force starts it
    anyway. Once the job has started, the spec
    as run is written to RUN/job.yaml, which `ringray resume RUN` and `ringray export RUN`
    read from wherever RUN has been moved.

    Example: ringray train jobs/quickstart.yaml --steps 20 --set train.seq_len=2048
    """
    run_job(load_spec(spec_path, overrides, steps=steps), address=address, force=force)


def run_job(spec: JobSpec, *, address: str | None, force: bool = False) -> None:
    """Run ``spec``'s job on Ray and follow it to its end (`ringray train`, `ringray resume`).
    What can be checked before Ray starts is checked first, each refusal in one line."""
    from ringray.spec.run_spec import run_spec_text

    job = _with_absolute_paths(spec.job_options())
    # job.yaml is written by the controller, which writes the rest of the run directory too
    job = replace(job, run_spec=run_spec_text(spec, run_dir=job.train.run_dir))
    if force:  # the workers' own check is off too
        job = _without_memory_check(job)
    source = "--address" if address else "$RAY_ADDRESS"  # what a message names
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:  # on a cluster, a running job of this name is reattached to instead
        _check_run_dir(job)
    _check_resume_step(job)
    if address is None and job.train.train.memory_check:
        _check_memory_here(job)
    options = job.train
    err.print(
        f"ringray: job {job.name!r}, {options.model.num_params() / 1e6:.2f}M-parameter model, "
        f"dp={job.dp_max} × cp={job.cp} ({options.layout_kind}), seq "
        f"{options.train.seq_len}, {options.train.steps} steps, "
        f"on {'Ray at ' + address if address else 'an embedded local Ray'}"
        f"{' (from $RAY_ADDRESS)' if address and source != '--address' else ''}",
        highlight=False,
    )
    _run_on_ray(spec, job, address=address, source=source)


def _check_run_dir(job: JobOptions) -> None:
    """Before Ray starts: the run directory is not in use by a live run, and a new run
    (``checkpoint.resume: false``) does not land on another run's checkpoints. The controller
    checks both again when it starts (the authoritative check)."""
    from ringray.train.checkpoint import CheckpointStore
    from ringray.train.checkpoint_runs import LocationInUse, check_new_run
    from ringray.train.run_lock import RunDirInUse, RunLock

    options = job.train
    try:
        RunLock(options.run_dir, job=job.name).check()
        if not options.checkpoint.resume:
            check_new_run(CheckpointStore(options.checkpoint_location),
                          move_aside=options.checkpoint.move_aside)
    except (RunDirInUse, LocationInUse) as exc:
        fail(str(exc))


def _check_resume_step(job: JobOptions) -> None:
    """Before Ray starts: a resumed run whose newest checkpoint is past ``train.steps`` would
    restore it, train nothing and report "finished at step 40/30"; it is refused instead."""
    from ringray.train.checkpoint import CheckpointStore
    from ringray.train.policy import steps_below_checkpoint

    options = job.train
    if not options.checkpoint.resume:
        return
    try:
        newest = CheckpointStore(options.checkpoint_location).latest()
    except (OSError, ValueError, ImportError):  # the controller reports the location itself
        return
    refusal = steps_below_checkpoint(options, newest)
    if refusal is not None:
        fail(refusal)


def _without_memory_check(job: JobOptions) -> JobOptions:
    """``job`` with ``train.memory_check`` off (``--force``)."""
    options = job.train
    return replace(job, train=replace(options, train=replace(options.train,
                                                             memory_check=False)))


def _check_memory_here(job: JobOptions) -> None:
    """Before an embedded Ray starts: refuse a job whose worker's planned peak memory
    exceeds what this machine gives it (see :mod:`ringray.train.memory_check`; the workers
    check again on their nodes, which is what a job on a cluster gets)."""
    from ringray.train.memory_check import WorkerShare, check_worker_memory, host_memory

    on_gpu = job.cluster.accelerator == "gpu"
    if on_gpu:
        device_bytes = _smallest_gpu_bytes()
        if device_bytes is None:  # no GPU here: the placement says so, naming what is missing
            return
        share = WorkerShare(node="this machine's GPU memory", node_bytes=device_bytes)
    else:
        try:
            where, node_bytes = host_memory("this host")
        except ValueError as exc:
            fail(str(exc))
        workers = job.train.parallel.dp_replicate * job.dp_max * job.cp
        share = WorkerShare(node=where, node_bytes=node_bytes, workers=workers)
    refusal = check_worker_memory(job.train, dp=job.dp_max, cp=job.cp, on_gpu=on_gpu,
                                  share=share)
    if refusal is not None:
        fail(refusal)


def _smallest_gpu_bytes() -> int | None:
    """The memory of this machine's smallest visible GPU, or ``None`` without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory
               for i in range(torch.cuda.device_count()))


def _with_absolute_paths(job: JobOptions) -> JobOptions:
    """Local paths made absolute: workers and the controller do not share our cwd."""
    options = job.train
    checkpoint = replace(options.checkpoint, path=_absolute(options.checkpoint_location))
    return replace(job, train=replace(options, run_dir=_absolute(options.run_dir),
                                      checkpoint=checkpoint))


def _absolute(location: str) -> str:
    """A local path made absolute (workers and the controller do not share our cwd)."""
    return location if "://" in location else str(Path(location).expanduser().resolve())


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is."""


def _terminate(signum, frame) -> None:
    raise _Terminated


def _signal_of(interrupt: KeyboardInterrupt) -> int:
    return signal.SIGTERM if isinstance(interrupt, _Terminated) else signal.SIGINT


def _deferring_stop_signals(work: Callable[[], T]) -> tuple[T, list[int]]:
    """``work()``, with Ctrl-C and SIGTERM held back until it returns; its result and the
    signals that came meanwhile, for the caller to handle as if they came next."""
    came: list[int] = []

    def hold(signum: int, frame: object) -> None:
        came.append(signum)

    previous = {signum: signal.signal(signum, hold)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = work()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return result, came


def _run_on_ray(spec: JobSpec, job: JobOptions, *, address: str | None,
                source: str = "--address") -> None:
    if address is None:
        # An embedded Ray listens on loopback only and ends with this command: Ray 2.60's
        # token authentication protects nothing there, and its token file outlives the run.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # `ringray stop` (Ray's job stop), `timeout` and systemd send SIGTERM: handled like
    # Ctrl-C, checkpoint and stop. Set before connect, which keeps it through ray.init.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        _follow_on_ray(spec, job, address=address, source=source)
    finally:
        if previous is not None:  # None: a handler not set from Python, which cannot restore it
            signal.signal(signal.SIGTERM, previous)


def _follow_on_ray(spec: JobSpec, job: JobOptions, *, address: str | None,
                   source: str) -> None:
    from ringray.cluster.driver import (
        ControllerLost,
        JobChanged,
        RayUnavailable,
        connect,
        follow,
        job_status,
        release,
        request_stop,
        start_controller,
    )

    world = job.workers_wanted  # every replica group's workers and the standby's
    try:
        with err.status("starting Ray..." if address is None else f"connecting to {address}..."):
            embedded = connect(address, local_cpus=max(world, os.cpu_count() or 1))
    except RayUnavailable as exc:
        fail(f"{source} {address}: {exc}" if address else str(exc))
    except KeyboardInterrupt as interrupt:
        err.print("interrupted while Ray was starting; the job did not start", highlight=False)
        raise typer.Exit(code=128 + _signal_of(interrupt)) from None
    note = None
    if embedded:  # nothing can join an embedded Ray: do not wait for capacity
        job = replace(job, cluster=replace(job.cluster, capacity_wait_seconds=0,
                                           request_resources=False))
        note = oversubscription_note(world=world, cores=os.cpu_count() or 1, cp=job.cp)
        if note:
            err.print(note, highlight=False)
    # A Ctrl-C or SIGTERM while the controller starts waits until there is one to stop.
    try:
        (controller, reattached), early = _deferring_stop_signals(
            lambda: start_controller(job))
    except JobChanged as exc:
        fail(str(exc))
    if reattached:
        err.print(f"reattached to the running job {job.name!r}")
    url = job_status(controller).metrics_url
    if url:
        err.print(f"metrics: {url} (Prometheus; dashboards in dashboards/)", highlight=False)
    # The controller's own event for that endpoint says the same: it is not printed again.
    view = _TrainView(job.train.train.steps, said=[f"metrics: {url}"] if url else [])
    final = None
    with view:
        while final is None:
            try:
                if early:
                    raise _Terminated if early.pop(0) == signal.SIGTERM else KeyboardInterrupt
                final = follow(controller, on_status=view.update)
            except ControllerLost as exc:
                fail(str(exc))
            except KeyboardInterrupt as interrupt:
                presses = view.interrupt(_signal_of(interrupt))
                if presses == 1:
                    # The state the request met, not the last one polled: a job seen
                    # starting may be training by now, and then it checkpoints first.
                    state = request_stop(controller)
                    view.say(_stopping_message(state, embedded=embedded))
                elif not embedded:
                    err.print("detached; the job goes on (ringray train with the same spec "
                              "reattaches)")
                    raise typer.Exit(code=view.exit_code) from None
                elif presses == 2:
                    view.say("still stopping: an embedded Ray cannot be detached (the job "
                             "ends with this command); Ctrl-C once more to quit without "
                             "waiting (the last committed checkpoint stays)")
                else:
                    err.print("quit without waiting for the stop; the last committed "
                              "checkpoint stays (ringray train resumes from it)")
                    raise typer.Exit(code=view.exit_code) from None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the job has ended: nothing to stop
    release(controller)
    _report_end(final, job.train.run_dir)
    if note and final.last_stats is not None:
        err.print(note, highlight=False)  # again beside the figures it explains
    if final.state == "stopped":
        raise typer.Exit(code=view.exit_code)  # checkpointed, but not finished


def _stopping_message(state: str, *, embedded: bool) -> str:
    """What the first Ctrl-C does, in the state the job is in."""
    again = ("Ctrl-C again to quit without waiting" if embedded
             else "Ctrl-C again to detach")
    if state == "evaluating":
        return (f"stopping: the passkey evaluation is abandoned (training is done and its "
                f"final checkpoint committed) ({again})")
    if state in ("running", "checkpointing"):
        return f"stopping: checkpoint at the next step boundary, then stop ({again})"
    return f"stopping: no checkpoint to take while {state}; the last committed one stays ({again})"


def oversubscription_note(*, world: int, cores: int, cp: int) -> str | None:
    """Why ranks wait for their peers when ranks outnumber this machine's cores, or
    ``None`` when each rank has a core of its own."""
    if world <= cores:
        return None
    fits = max(1, cores // max(1, world // cp))
    return (f"note: {world} ranks share {cores} CPU core(s) here, so a rank often waits for a "
            f"peer that is not scheduled; that wait is reported as peer wait "
            f"(peer_wait_seconds in steps.jsonl), apart from the overlap figure, which counts "
            f"only transfers not hidden (with a core per rank, e.g. --set "
            f"parallel.cp={fits}, the peer wait shrinks)")


class _TrainView:
    """A progress bar with one live line, and the controller's events printed above it.

    On a console that is not a terminal (stderr piped to a file, as CI does) nothing is
    redrawn: the events are printed as they come, each on one line, and the live line once
    at the end, whole. (Rich's own last frame there is cut to its 80 columns mid-word.)
    ``said``: event messages the driver has already printed itself, not printed again."""

    def __init__(self, total_steps: int, *, console: Console | None = None,
                 said: Collection[str] = ()) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        console = console or err
        self.live = console.is_terminal and not console.is_dumb_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.fields[state]:<13}"), BarColumn(bar_width=24),
            MofNCompleteColumn(), TextColumn("{task.fields[line]}"),
            console=console, transient=False, disable=not self.live,
        )
        self.total_steps = total_steps
        self.task = self.progress.add_task("train", total=total_steps, state="placing",
                                           line="")
        self.said = set(said)
        self.step = 0
        self.line = ""
        self.events_seen = 0.0
        self.interrupts = 0
        self.first_signal = signal.SIGINT  # what stopped the job (a stop by another client: 130)
        self.state = "placing"  # the job's state at the last update

    def interrupt(self, signum: int) -> int:
        """Count a Ctrl-C or SIGTERM (``signum``); returns how many there have been."""
        self.interrupts += 1
        if self.interrupts == 1:
            self.first_signal = signum
        return self.interrupts

    @property
    def exit_code(self) -> int:
        """The command's exit code once the job is stopped: 128 + the signal that stopped it
        (130 for Ctrl-C, 143 for SIGTERM), as shells report a process a signal ended."""
        return 128 + self.first_signal

    def __enter__(self) -> _TrainView:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()
        if not self.live:  # the live line's last state, once, as long as it is
            self.say(f"{self.state:<13} {self.step}/{self.total_steps}  {self.line}")

    def say(self, message: str) -> None:
        # Not a terminal: one line whatever its length (a file has no width to wrap at).
        self.progress.console.print(message, highlight=False, soft_wrap=not self.live)

    def update(self, status) -> None:
        for event in status.events:
            if event.time > self.events_seen:
                self.events_seen = event.time
                if not event.message.startswith("state: ") and event.message not in self.said:
                    self.say(f"  {event.message}")
        self.state, self.step = status.state, status.step
        self.line = format_status_line(status)
        self.progress.update(self.task, completed=status.step, state=status.state,
                             line=self.line)


def replicas_not_healed(status) -> int:
    """Replica groups lost and not healed since: their replacement is still starting or
    healing (a loss before the job's last restart was made good by the restart)."""
    restarted_at = status.restarts[-1].failed_at_step if status.restarts else -1
    return sum(1 for loss in status.replica_losses
               if loss.healed_at_step is None and loss.at_step > restarted_at)


def format_status_line(status) -> str:
    """step, loss, tokens/s, overlap, peer wait, imbalance, world size, restarts: the live
    line."""
    stats = status.last_stats
    groups = status.replica_groups
    live = status.world_size
    if groups > 1:  # a lost group's workers are not the job's until its replacement heals
        live -= replicas_not_healed(status) * (status.world_size // groups)
    world = f"world {live}/{groups * status.target_dp * status.cp}"
    restarts = f"restarts {len(status.restarts)}"
    if groups > 1:  # replica groups in the last step's quorum, and groups lost so far
        taking = len(stats.replicas_participating) if stats is not None else 0
        restarts += f"  replicas {taking}/{groups} (lost {len(status.replica_losses)})"
    if status.nonfinite_skipped:
        restarts += f"  non-finite skipped {status.nonfinite_skipped}"
    if stats is None:
        return f"{world}  {restarts}"
    return (f"loss {stats.loss:.4f}  {stats.tokens_per_second:,.0f} tok/s  "
            f"overlap {stats.overlap_ratio:.3f}  peer wait {stats.peer_wait_seconds_max:.3f}s  "
            f"imbalance {stats.load_imbalance:.3f}  "
            f"{world}  {restarts}")


def _report_end(status, run_dir: str) -> None:
    out = Console()
    if status.restarts:
        table = Table(title="restarts", title_justify="left")
        for col in ("reason", "at step", "resumed from", "lost steps", "recovery s", "world"):
            table.add_column(col, justify="right")
        for r in status.restarts:
            table.add_row(
                r.reason, str(r.failed_at_step), _or_dash(r.resumed_from_step),
                _or_dash(r.lost_steps),
                f"{r.recovery_seconds:.1f}" if r.recovery_seconds is not None else "-",
                f"{r.world_size_before} → {_or_dash(r.world_size_after)}",
            )
        out.print(table)
    if status.replica_losses:
        table = Table(title="replica groups lost (the others trained on; no step rolled back)",
                      title_justify="left")
        for col in ("group", "reason", "at step", "healed at step", "heal s"):
            table.add_column(col, justify="right")
        for loss in status.replica_losses:
            table.add_row(str(loss.group), loss.reason, str(loss.at_step),
                          _or_dash(loss.healed_at_step),
                          f"{loss.heal_seconds:.2f}" if loss.heal_seconds is not None else "-")
        out.print(table)
    if status.state == "failed":
        fail(f"job {status.job_name!r} failed at step {status.step}: {status.error}")
    kept = [name for name in ("passkey.json", "eval/results.json")
            if (Path(run_dir) / name).exists()]
    out.print(f"job {status.job_name!r} {status.state} at step {status.step}/"
              f"{status.total_steps}; run directory {run_dir} (steps.jsonl, events.jsonl"
              f"{''.join(', ' + name for name in kept)})",
              highlight=False, markup=False, soft_wrap=True)  # one line: `status` quotes it


def _or_dash(value) -> str:
    return "-" if value is None else str(value)
