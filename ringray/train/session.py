"""One training session: a run's life on every rank, written once for torchrun and for Ray.

    run = on_rank0(lambda: plan_session(options))        # lineage + restore candidates
    session = TrainingSession(options, run)               # every rank (collective)
    restored = session.restore()                          # newest usable checkpoint, or none
    while session.step_count < options.train.steps:
        stats = session.step()
        if checkpoint_due(stats.step, options):
            saved = session.checkpoint()
    report = session.evaluate()                           # the job's passkey evaluation

Two drivers run sessions. :func:`ringray.train.loop.run_training` (torchrun, or one plain
process) runs the loop above on every rank; under Ray, each worker actor holds a session and
the job's controller calls it one step, checkpoint or evaluation at a time
(:mod:`ringray.cluster.worker`), deciding when to checkpoint with the same
:func:`checkpoint_due`. What a session returns is written to the run directory by one process,
with :class:`ringray.train.run_dir.RunDirectory`: rank 0 under torchrun, the controller under
Ray.

Every method is collective over the job's ranks except :func:`plan_session`, which reads the
checkpoint location (one rank, or the controller's chosen worker, calls it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ringray.data import PasskeyReport, evaluate_passkey
from ringray.train.checkpoint import (
    CheckpointCorrupt,
    CheckpointRef,
    CheckpointStore,
)
from ringray.train.checkpoint_runs import RunPlan, plan_run
from ringray.train.options import TrainOptions
from ringray.train.replicas import ReplicaMembership, ReplicaSync
from ringray.train.sharding import local_tensor
from ringray.train.step_stats import StepStats
from ringray.train.trainer import Trainer


@dataclass(frozen=True, kw_only=True)
class Restored:
    """What a session's restore found."""

    step: int
    """The trainers' step after the restore (0: a fresh start)."""
    checkpoint: CheckpointRef | None
    """The checkpoint loaded, or ``None``."""
    refused: tuple[str, ...] = ()
    """Why each newer checkpoint was refused (one line each), newest first."""


class NonFiniteSteps(ValueError):
    """Steps in a row whose loss or gradient norm was not finite, past
    ``train.nonfinite_skips``: the run stops (a retry would meet the same weights and data)."""


class NonFiniteWeights(ValueError):
    """A checkpoint refused because a weight is not finite (nothing was written)."""


@dataclass(frozen=True, kw_only=True)
class Saved:
    """A committed checkpoint and what went wrong without failing it (pruning)."""

    checkpoint: CheckpointRef
    warnings: tuple[str, ...] = ()


def plan_session(options: TrainOptions, *, lineage: str | None = None) -> RunPlan:
    """The run's lineage and restore candidates, newest first, as this process sees the
    checkpoint location. At a run's first start (``lineage`` None) per the job's
    ``checkpoint.resume`` and ``checkpoint.move_aside`` (:func:`~ringray.train.checkpoint.
    plan_run`, which may move an earlier run aside or refuse to start); on a restart of the
    same run, the checkpoints of ``lineage`` newest first, damaged ones included (refused with
    their reason when tried, never skipped silently)."""
    store = CheckpointStore(options.checkpoint_location)
    if lineage is None:
        return plan_run(store, resume=options.checkpoint.resume,
                        move_aside=options.checkpoint.move_aside)
    return RunPlan(lineage=lineage, restore=tuple(store.restore_order(lineage)))


def checkpoint_due(step: int, options: TrainOptions) -> bool:
    """Whether the step just done is checkpointed: every ``checkpoint.interval`` steps and the
    last one (``train.steps``)."""
    interval = options.checkpoint.interval
    return step >= options.train.steps or bool(interval and step % interval == 0)


class TrainingSession:
    """One rank's part of a run: its trainer and the run's checkpoint store (lineage)."""

    def __init__(self, options: TrainOptions, run: RunPlan, *,
                 replicas: ReplicaSync | None = None) -> None:
        self.options = options
        self.run = run
        # replicas: this rank's link to the other replica groups (parallel.dp_replicate)
        self.trainer = Trainer(options, replicas=replicas)
        # Probes (device peak, ring transfer rate) once per session, before the first step,
        # so that step's time is the step's.
        self.trainer.calibrate()
        self.store = CheckpointStore(options.checkpoint_location, lineage=run.lineage)
        # A location the ranks do not share (a node-local disk on several nodes) is refused
        # now, on every rank, not at the first save after hours of training.
        self.store.check_shared()

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    def restore(self, *, on_refused: Callable[[str], None] | None = None) -> Restored:
        """Load the newest restore candidate that verifies and loads, falling back past
        corrupt ones (each refusal is one line, also passed to ``on_refused`` as it happens).

        Raises:
            CheckpointCorrupt: every candidate is corrupt (training would silently start
                over); the message says how to start over on purpose.
            CheckpointError: the checkpoint belongs to another model.
        """
        refused: list[CheckpointCorrupt] = []
        for ref in self.run.restore:
            try:  # the load verifies sizes and checksums first, every rank its share
                self.trainer.load_checkpoint(self.store, ref)
            except CheckpointCorrupt as exc:
                refused.append(exc)
                if on_refused is not None:
                    on_refused(str(exc))
                continue
            return Restored(step=self.trainer.step_count, checkpoint=ref,
                            refused=tuple(str(exc) for exc in refused))
        if refused:
            raise CheckpointCorrupt(
                f"no usable checkpoint at {self.store.location}: {len(refused)} refused, each "
                f"failing its own files' check, the newest because {refused[0]}; restore "
                f"them from a copy, or train afresh at another checkpoint.path (nothing "
                f"there is deleted)", refused[0].ref)
        return Restored(step=self.trainer.step_count, checkpoint=None)

    def step(self) -> StepStats:
        """One optimizer step on every rank (or a replica group's attempt it did not commit).

        An attempt whose loss or gradient norm is not finite is not a step: nothing of it is
        applied, its batch is passed over and the next batch is tried, at most
        ``train.nonfinite_skips`` times in a row; the step finally taken reports how many
        were passed over (``nonfinite_skipped``).

        Raises:
            NonFiniteSteps: one attempt more than ``train.nonfinite_skips`` in a row was not
                finite (one line naming the step, the values and the field).
        """
        limit = self.options.train.nonfinite_skips
        skipped = 0
        while True:
            stats = self.trainer.step()
            if stats.finite or not stats.committed:
                return replace(stats, nonfinite_skipped=skipped) if skipped else stats
            skipped += 1
            if skipped > limit:
                raise NonFiniteSteps(
                    f"step {stats.step + 1}: not finite in {skipped} attempt"
                    f"{'s' if skipped > 1 else ''} in a row, each on a new batch (the last: "
                    f"loss {stats.loss:.4g}, gradient norm {stats.grad_norm:.4g}; "
                    f"train.nonfinite_skips: {limit}); none was applied or checkpointed. "
                    f"Lower train.optimizer.lr (now {self.options.train.optimizer.lr:g}), or "
                    f"check the data and the starting weights")

    def checkpoint(self) -> Saved:
        """Save and commit the current step; pruning problems come back as warnings.

        Raises:
            NonFiniteWeights: a weight holds a NaN or an infinity; nothing is written, so the
                newest committed checkpoint (and every one pruning would have removed) stays.
        """
        bad = self.trainer.nonfinite_weight()
        if bad is not None:
            raise NonFiniteWeights(
                f"step {self.step_count}: not checkpointed: weight {bad} holds a NaN or an "
                f"infinity (the optimizer's update overflowed; lower "
                f"train.optimizer.lr, now {self.options.train.optimizer.lr:g}); the newest "
                f"committed checkpoint stays the one to resume")
        ref = self.trainer.save_checkpoint(self.store)
        warnings, self.store.warnings = tuple(self.store.warnings), []
        return Saved(checkpoint=ref, warnings=warnings)

    def take_replica_place(self, group: ReplicaMembership) -> None:
        """A standby replica group's session, built ahead, takes a lost group's place
        (:meth:`~ringray.train.replicas.ReplicaSync.take_place`)."""
        if self.trainer.replicas is None:
            raise RuntimeError("take_replica_place: this session belongs to no replica group")
        self.trainer.replicas.take_place(group)

    def fall_behind(self) -> None:
        """This replica group heals from a live peer at its next step (its state differs)."""
        if self.trainer.replicas is None:
            raise RuntimeError("fall_behind: this session belongs to no replica group")
        self.trainer.replicas.fall_behind()

    def close(self) -> None:
        """Shut this rank's torchft manager down (a replica group's), so the Lighthouse and
        the peers see the group leave; nothing else holds a server."""
        if self.trainer.replicas is not None:
            self.trainer.replicas.shutdown()

    def state_digest(self) -> str:
        """A SHA-256 of this rank's training state: its weights and optimizer state (its
        shards under FSDP), loader position, RNG and step. Replica groups in step hold equal
        digests rank for rank."""
        digest = hashlib.sha256()

        def add(value: Any, path: str) -> None:
            if isinstance(value, dict):
                for key in sorted(value, key=str):
                    add(value[key], f"{path}/{key}")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    add(item, f"{path}/{i}")
            elif isinstance(value, torch.Tensor):
                local = local_tensor(value).detach().cpu().contiguous()
                digest.update(f"{path}:{local.dtype}:{tuple(local.shape)}".encode())
                digest.update(local.reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                digest.update(f"{path}={value!r}".encode())

        add(self.trainer.state_dict(), "")
        return digest.hexdigest()

    def evaluate(self) -> PasskeyReport | None:
        """The job's passkey evaluation, or ``None`` when it asks for none."""
        passkey = self.options.eval
        if not passkey.passkey_lengths:
            return None
        trainer = self.trainer
        return evaluate_passkey(
            trainer.predict_next_tokens, trainer.tokenizer,
            lengths=passkey.passkey_lengths, depths=passkey.passkey_depths,
            samples_per_cell=passkey.passkey_samples, seed=passkey.passkey_seed,
        )
