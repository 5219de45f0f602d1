"""The run's rules, written once and consumed by both drivers (``run_training`` under
torchrun, the job's controller under Ray) and by ``ringray train`` before Ray starts:

    refusal = steps_below_checkpoint(options, ref)   # a resume past train.steps: one line
    final_checkpoint_due(step, saved_step, options)  # the last step has no checkpoint yet
    evaluation_due(options)                           # what follows the final checkpoint
    model_config_differences(saved, current)          # the model-config check's wording

Each rule has one wording and one test (``tests/test_run_policy.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ringray.train.checkpoint_ref import CheckpointRef
from ringray.train.options import TrainOptions


def steps_below_checkpoint(options: TrainOptions, ref: CheckpointRef | None) -> str | None:
    """The one-line refusal of a run whose checkpoint to resume (``ref``) is past
    ``train.steps`` (it would restore it, train nothing and report "finished at step 40/30"),
    else ``None``."""
    steps = options.train.steps
    if ref is None or ref.step <= steps:
        return None
    return (f"train.steps: {steps} is below step {ref.step} of the checkpoint this run resumes "
            f"({ref.location}); set train.steps to {ref.step} or more (--steps with ringray "
            f"train), or give a new run_dir to train afresh")


def final_checkpoint_due(step: int, saved_step: int | None, options: TrainOptions) -> bool:
    """Whether the run has reached ``train.steps`` at ``step`` and its newest committed
    checkpoint (``saved_step``) is not of that step: it is written before anything follows
    (the evaluation, the end), so a finished run always ends on a checkpoint of its last step
    (a run resumed at its last step included)."""
    return step >= options.train.steps and saved_step != step


def evaluation_due(options: TrainOptions) -> bool:
    """Whether the run evaluates after its final checkpoint (``eval.passkey_lengths`` or
    ``eval.tasks``)."""
    return options.eval.due


def model_config_differences(saved: Mapping[str, object], current: Mapping[str, object]) -> str:
    """The model-config check's wording: each field that differs with both values (sorted),
    or ``""`` when they agree."""
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    return ", ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now"
                     for k in changed)
