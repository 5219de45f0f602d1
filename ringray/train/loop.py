"""The training run: resume, step, log, checkpoint, evaluate.

    result = run_training(options)        # every rank calls it; rank 0 writes and prints

A run directory holds ``steps.jsonl`` (one :class:`StepStats` per line), the checkpoints
(unless they are placed elsewhere), the lock of the run using it (``ringray.lock``) and, after
a passkey evaluation, ``passkey.json``. A run that finds a committed checkpoint of its lineage
resumes from it; ``steps.jsonl`` is cut back to that step, so it always describes the
training that produced the current weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ringray.data import PasskeyReport, evaluate_passkey
from ringray.train.checkpoint import (
    CheckpointCorrupt,
    CheckpointRef,
    CheckpointStore,
    plan_run,
)
from ringray.train.collective import on_rank0
from ringray.train.options import TrainOptions
from ringray.train.run_lock import RunLock
from ringray.train.step_stats import StepStats
from ringray.train.trainer import Trainer

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


class StepsLog:
    """A run's ``steps.jsonl``: one :class:`StepStats` per line, in step order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def truncate(self, last_step: int) -> None:
        """Drop the lines after ``last_step`` (the steps a resumed run does again)."""
        if not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= last_step
        ]
        self.path.write_text("".join(f"{line}\n" for line in kept))

    def append(self, stats: StepStats) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(stats.to_dict()) + "\n")


def evaluate_passkey_retrieval(trainer: Trainer) -> PasskeyReport | None:
    """The job's passkey evaluation (collective: every rank calls it), or ``None`` when the
    options ask for none."""
    options = trainer.options.eval
    if not options.passkey_lengths:
        return None
    return evaluate_passkey(
        trainer.predict_next_tokens, trainer.tokenizer,
        lengths=options.passkey_lengths, depths=options.passkey_depths,
        samples_per_cell=options.passkey_samples, seed=options.passkey_seed,
    )


def move_logs_aside(run_dir: Path, suffix: str) -> list[str]:
    """Rank 0, when an earlier run's checkpoints were moved aside: its ``steps.jsonl`` and
    ``events.jsonl`` go with them (``steps.previous-<time>.jsonl``); returns what moved."""
    moved = []
    for name in ("steps.jsonl", "events.jsonl"):
        path = run_dir / name
        if path.exists():
            target = run_dir / f"{path.stem}.{suffix}{path.suffix}"
            path.rename(target)
            moved.append(str(target))
    return moved


def restore_newest(trainer: Trainer, store: CheckpointStore, candidates: tuple[CheckpointRef, ...],
                   *, on_refused: Callable[[str], None]) -> CheckpointRef | None:
    """Load the newest of ``candidates`` (newest first) that verifies and loads (collective).

    A corrupt one (a file missing or truncated) is refused, ``on_refused`` is told why (one
    line), and the previous one is tried; ``None`` when there are no candidates.

    Raises:
        CheckpointCorrupt: every candidate is corrupt (training would silently start over).
        CheckpointError: the checkpoint belongs to another model.
    """
    refused = []
    for ref in candidates:
        try:
            on_rank0(lambda ref=ref: store.verify(ref))
            trainer.load_checkpoint(store, ref)
            return ref
        except CheckpointCorrupt as exc:
            refused.append(exc)
            on_refused(str(exc))
    if refused:
        raise CheckpointCorrupt(
            f"no usable checkpoint at {store.location}: {len(refused)} refused, the newest "
            f"because {refused[0]}; to start over, set checkpoint.resume: false with "
            f"checkpoint.move_aside: true", refused[0].ref)
    return None


def run_training(
    options: TrainOptions,
    *,
    stop_after: int | None = None,
    log: Log = print,
) -> RunResult:
    """Train to ``train.steps`` (or stop after step ``stop_after``, as an interrupted run
    would), checkpointing every ``checkpoint.interval`` steps and at the end.

    Rank 0 holds the run directory's lock for the whole run. The run resumes the newest
    lineage at the checkpoint location (``checkpoint.resume``), falling back past corrupt
    checkpoints, or starts a new lineage (refused if another run's checkpoints are there,
    unless ``checkpoint.move_aside``).
    """
    trainer = Trainer(options)
    is_writer = trainer.mesh.rank == 0
    say: Log = log if is_writer else (lambda _: None)
    run_dir = Path(options.run_dir)
    lock = RunLock(run_dir, job=run_dir.name)
    note = on_rank0(lock.acquire)
    if note:
        say(note)
    try:
        return _run(trainer, options, run_dir, stop_after=stop_after, say=say)
    finally:
        if is_writer:
            lock.release()


def _run(trainer: Trainer, options: TrainOptions, run_dir: Path, *, stop_after: int | None,
         say: Log) -> RunResult:
    is_writer = trainer.mesh.rank == 0
    checkpoint = options.checkpoint
    plan = on_rank0(lambda: plan_run(CheckpointStore(options.checkpoint_location),
                                     resume=checkpoint.resume, move_aside=checkpoint.move_aside))
    store = CheckpointStore(options.checkpoint_location, lineage=plan.lineage)
    if plan.moved_aside_to:
        say(f"moved the earlier run's checkpoints aside to {plan.moved_aside_to}")
        if is_writer:
            suffix = plan.moved_aside_to.rsplit(".", 1)[-1]
            for moved in move_logs_aside(run_dir, suffix):
                say(f"moved the earlier run's log aside to {moved}")
    shape, train = trainer.mesh.shape, options.train
    say(
        f"ringray: {options.model.num_params() / 1e6:.2f}M-parameter model, "
        f"dp={shape.dp} × cp={shape.cp} ({options.layout_kind}), seq {train.seq_len}, "
        f"global batch {train.global_batch}, {train.steps} steps, device {trainer.device}"
    )

    resumed_from = None
    restored = restore_newest(
        trainer, store, plan.restore,
        on_refused=lambda why: say(f"refused {why}; falling back to the previous checkpoint"))
    if restored is not None:
        resumed_from = trainer.step_count
        say(f"resumed from {restored.location} (step {resumed_from})")
    steps_log = StepsLog(run_dir / "steps.jsonl")
    if is_writer:
        steps_log.truncate(trainer.step_count)

    last_stats, saved = None, restored
    end = train.steps if stop_after is None else min(stop_after, train.steps)
    interval = checkpoint.interval
    while trainer.step_count < end:
        last_stats = trainer.step()
        if is_writer:
            steps_log.append(last_stats)
        step = last_stats.step
        if step == 1 or step % train.log_every == 0 or step == end:
            say(format_step(last_stats, train.steps))
        if interval and last_stats.step % interval == 0:
            saved = _save(trainer, store, say)
    if stop_after is None and (saved is None or saved.step != trainer.step_count):
        saved = _save(trainer, store, say)

    passkey = None
    if stop_after is None and options.eval.passkey_lengths:
        say(f"passkey retrieval at lengths {list(options.eval.passkey_lengths)} ...")
        passkey = evaluate_passkey_retrieval(trainer)
        if is_writer:
            (run_dir / "passkey.json").write_text(json.dumps(passkey.to_dict(), indent=2))
        say(passkey.format_table())
    return RunResult(
        resumed_from=resumed_from, last_step=trainer.step_count, last_stats=last_stats,
        checkpoint=saved, passkey=passkey,
    )


def _save(trainer: Trainer, store: CheckpointStore, say: Log) -> CheckpointRef:
    ref = trainer.save_checkpoint(store)
    say(f"checkpoint {ref.location}")
    for warning in store.warnings:
        say(f"warning: {warning}")
    store.warnings.clear()
    return ref
