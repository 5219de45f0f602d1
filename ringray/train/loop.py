"""The training run: resume, step, log, checkpoint, evaluate.

    result = run_training(options)        # every rank calls it; rank 0 writes and prints

A run directory holds ``steps.jsonl`` (one :class:`StepStats` per line), the checkpoints
(unless they are placed elsewhere) and, after a passkey evaluation, ``passkey.json``. A run
that finds a complete checkpoint resumes from it; ``steps.jsonl`` is cut back to that step,
so it always describes the training that produced the current weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ringray.data import PasskeyReport, evaluate_passkey
from ringray.train.checkpoint import CheckpointRef, CheckpointStore
from ringray.train.options import TrainOptions
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
        f"overlap {stats.overlap_ratio:6.3f}  imbalance {stats.load_imbalance:5.3f}  mfu {mfu}"
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


def run_training(
    options: TrainOptions,
    *,
    stop_after: int | None = None,
    log: Log = print,
) -> RunResult:
    """Train to ``train.steps`` (or stop after step ``stop_after``, as an interrupted run
    would), checkpointing every ``checkpoint.interval`` steps and at the end."""
    trainer = Trainer(options)
    is_writer = trainer.mesh.rank == 0
    say: Log = log if is_writer else (lambda _: None)
    run_dir = Path(options.run_dir)
    if is_writer:
        run_dir.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(options.checkpoint_location)
    shape, train = trainer.mesh.shape, options.train
    say(
        f"ringray: {options.model.num_params() / 1e6:.2f}M-parameter model, "
        f"dp={shape.dp} × cp={shape.cp} ({options.parallel.layout}), seq {train.seq_len}, "
        f"global batch {train.global_batch}, {train.steps} steps, device {trainer.device}"
    )

    resumed_from = None
    if options.checkpoint.resume and (ref := store.latest()) is not None:
        trainer.load_checkpoint(store, ref)
        resumed_from = trainer.step_count
        say(f"resumed from {ref.location} (step {resumed_from})")
    steps_log = StepsLog(run_dir / "steps.jsonl")
    if is_writer:
        steps_log.truncate(trainer.step_count)

    last_stats, checkpoint = None, None
    end = train.steps if stop_after is None else min(stop_after, train.steps)
    interval = options.checkpoint.interval
    while trainer.step_count < end:
        last_stats = trainer.step()
        if is_writer:
            steps_log.append(last_stats)
        step = last_stats.step
        if step == 1 or step % train.log_every == 0 or step == end:
            say(format_step(last_stats, train.steps))
        if interval and last_stats.step % interval == 0:
            checkpoint = trainer.save_checkpoint(store)
            say(f"checkpoint {checkpoint.location}")
    if stop_after is None:
        checkpoint = store.latest()
        if checkpoint is None or checkpoint.step != trainer.step_count:
            checkpoint = trainer.save_checkpoint(store)
            say(f"checkpoint {checkpoint.location}")

    passkey = None
    if stop_after is None and options.eval.passkey_lengths:
        say(f"passkey retrieval at lengths {list(options.eval.passkey_lengths)} ...")
        passkey = evaluate_passkey_retrieval(trainer)
        if is_writer:
            (run_dir / "passkey.json").write_text(json.dumps(passkey.to_dict(), indent=2))
        say(passkey.format_table())
    return RunResult(
        resumed_from=resumed_from, last_step=trainer.step_count, last_stats=last_stats,
        checkpoint=checkpoint, passkey=passkey,
    )
