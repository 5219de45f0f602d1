"""The training run under torchrun (or in one plain process): a loop over a training session.

    result = run_training(options)        # every rank calls it; rank 0 writes and prints

Each rank holds a :class:`~ringray.train.session.TrainingSession` (restore, step, checkpoint,
evaluate: the same session a Ray worker holds); rank 0 writes the run directory through
:class:`~ringray.train.run_dir.RunDirectory` (its lock, ``steps.jsonl``, ``passkey.json``),
as the controller does under Ray. A run that finds a committed checkpoint of its lineage
resumes from it; ``steps.jsonl`` is cut back to that step, so it always describes the
training that produced the current weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ringray.data import PasskeyReport
from ringray.train.checkpoint import CheckpointRef
from ringray.train.collective import is_rank0, on_rank0, world_size
from ringray.train.options import TrainOptions
from ringray.train.policy import final_checkpoint_due, steps_below_checkpoint
from ringray.train.replicas import ReplicaMembership, ReplicaSync
from ringray.train.run_dir import RunDirectory
from ringray.train.session import Saved, TrainingSession, checkpoint_due, plan_session
from ringray.train.step_stats import StepStats
from ringray.train.trainer import check_world, default_device

Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """How a run ended (returned on every rank)."""

    resumed_from: int | None
    last_step: int
    last_stats: StepStats | None
    checkpoint: CheckpointRef | None
    passkey: PasskeyReport | None


def format_step(stats: StepStats, total_steps: int) -> str:
    """One progress line."""
    mfu = f"{stats.mfu:6.1%}" if stats.mfu is not None else "   n/a"
    return (
        f"step {stats.step:>5}/{total_steps}  loss {stats.loss:7.4f}  "
        f"lr {stats.learning_rate:.2e}  {stats.tokens_per_second:9.0f} tok/s  "
        f"overlap {stats.overlap_ratio:6.3f}  peer wait {stats.peer_wait_seconds_max:6.3f}s  "
        f"imbalance {stats.load_imbalance:5.3f}  mfu {mfu}"
    )


UNCOMMITTED_ATTEMPTS = 5
"""Steps in a row a replica group may fail to commit before the run stops with an error."""


def run_training(
    options: TrainOptions,
    *,
    stop_after: int | None = None,
    log: Log = print,
    on_start: Callable[[], None] | None = None,
    replica: ReplicaMembership | None = None,
) -> RunResult:
    """Train to ``train.steps`` (or stop after step ``stop_after``, as an interrupted run
    would), checkpointing every ``checkpoint.interval`` steps and at the end.

    Rank 0 holds the run directory's lock for the whole run. The run resumes the newest
    lineage at the checkpoint location (``checkpoint.resume``), falling back past corrupt
    checkpoints, or starts a new lineage (refused if another run's checkpoints are there,
    unless ``checkpoint.move_aside``).

    ``on_start`` is called on rank 0 once the job has started (the trainer is built, nothing
    was refused), before any checkpoint is restored: ``python -m ringray.train`` writes the
    run's job.yaml there, so that ``ringray export`` and ``ringray resume`` read the run.

    ``replica``: this world is one replica group of ``parallel.dp_replicate``
    (:mod:`ringray.train.replicas`; under torchrun, one torchrun per group). A step the
    groups do not commit is taken again and not logged.
    """
    writer = is_rank0()
    run_dir = RunDirectory(options.run_dir, job=Path(options.run_dir).name)
    note = on_rank0(run_dir.open)
    say: Log = log if writer else (lambda _: None)
    if note:
        say(note)
    try:
        return _run(options, run_dir if writer else None, stop_after=stop_after, say=say,
                    on_start=on_start if writer else None, replica=replica)
    finally:
        if writer:
            run_dir.close()


def _run(options: TrainOptions, run_dir: RunDirectory | None, *, stop_after: int | None,
         say: Log, on_start: Callable[[], None] | None,
         replica: ReplicaMembership | None) -> RunResult:
    # A job this world or device cannot run is refused here, on every rank alike, before rank 0
    # moves an earlier run aside (checkpoint.move_aside) or any model is built.
    check_world(options, world_size(), default_device())
    run = on_rank0(lambda: plan_session(options))
    if run.moved_aside_to:
        say(f"moved the earlier run's checkpoints aside to {run.moved_aside_to}")
        if run_dir is not None:
            for moved in run_dir.moved_aside(run.moved_aside_to):
                say(f"moved the earlier run's log aside to {moved}")
    newest = run.restore[0] if run.restore else None  # every rank holds rank 0's plan
    refusal = steps_below_checkpoint(options, newest)
    if refusal is not None:
        # Refused alike on every rank, before a model is built or job.yaml rewritten (as
        # `ringray train` refuses it before Ray starts).
        raise ValueError(refusal)
    session = TrainingSession(options, run,
                              replicas=ReplicaSync(replica) if replica is not None else None)
    try:
        return _train(options, run_dir, session, stop_after=stop_after, say=say,
                      on_start=on_start)
    finally:
        session.close()  # a replica group's torchft manager: the others see it leave


def _train(options: TrainOptions, run_dir: RunDirectory | None, session: TrainingSession, *,
           stop_after: int | None, say: Log, on_start: Callable[[], None] | None) -> RunResult:
    shape, train = session.trainer.mesh.shape, options.train
    sync = session.trainer.replicas
    replica = sync.group if sync is not None else None
    group = "" if replica is None else f", replica group {replica.index} of {replica.count}"
    say(
        f"ringray: {options.model.num_params() / 1e6:.2f}M-parameter model (built and "
        f"{'loaded' if options.pretrained else 'initialised'} in "
        f"{session.trainer.model_seconds:.1f} s), "
        f"dp={shape.dp} × cp={shape.cp} ({options.layout_kind}), seq {train.seq_len}, "
        f"global batch {train.global_batch}, {train.steps} steps, device "
        f"{session.trainer.device}{group}"
    )
    if on_start is not None:
        on_start()

    restored = session.restore(
        on_refused=lambda why: say(f"refused {why}; falling back to the previous checkpoint"))
    resumed_from = restored.step if restored.checkpoint is not None else None
    if restored.checkpoint is not None:
        say(f"resumed from {restored.checkpoint.location} (step {restored.step})")
    if run_dir is not None:
        for warning in run_dir.restarted_at(restored.step):
            say(f"warning: {warning}")

    last_stats, saved = None, restored.checkpoint
    end = train.steps if stop_after is None else min(stop_after, train.steps)
    uncommitted = 0
    while session.step_count < end:
        last_stats = session.step()
        if not last_stats.committed:  # a replica group failed inside it: taken again
            uncommitted += 1
            if uncommitted >= UNCOMMITTED_ATTEMPTS:
                raise RuntimeError(
                    f"step {session.step_count + 1}: not committed in {uncommitted} attempts "
                    f"in a row (torchft's quorum or its average kept failing; is the "
                    f"Lighthouse at {replica.lighthouse if replica else '-'} up?)")
            continue
        uncommitted = 0
        if run_dir is not None:
            run_dir.record_step(last_stats)
        step = last_stats.step
        if last_stats.nonfinite_skipped:
            say(f"step {step}: {last_stats.nonfinite_skipped} attempt(s) before it passed over, "
                f"their loss or gradient norm not finite (train.nonfinite_skips: "
                f"{train.nonfinite_skips} in a row)")
        if step == 1 or step % train.log_every == 0 or step == end:
            say(format_step(last_stats, train.steps))
        if checkpoint_due(step, options):
            saved = _saved(session.checkpoint(), say)
    if stop_after is None and final_checkpoint_due(
            session.step_count, saved.step if saved is not None else None, options):
        saved = _saved(session.checkpoint(), say)  # a run resumed at its last step too

    passkey = None
    evaluation = options.eval
    if stop_after is None and evaluation.passkey_lengths:
        say(f"passkey retrieval at lengths {list(evaluation.passkey_lengths)} ...")
        passkey = session.evaluate()
        if run_dir is not None:
            run_dir.record_passkey(passkey)
        say(passkey.format_table())
    if stop_after is None and evaluation.tasks:  # the harness sits above this layer
        say(f"eval.tasks: the Ray service runs them after training; here, run ringray eval "
            f"{options.run_dir} --tasks {','.join(evaluation.tasks)} --lengths "
            f"{','.join(map(str, evaluation.task_lengths))} --limit {evaluation.task_samples}")
    return RunResult(
        resumed_from=resumed_from, last_step=session.step_count, last_stats=last_stats,
        checkpoint=saved, passkey=passkey,
    )


def _saved(saved: Saved, say: Log) -> CheckpointRef:
    say(f"checkpoint {saved.checkpoint.location}")
    for warning in saved.warnings:
        say(f"warning: {warning}")
    return saved.checkpoint
