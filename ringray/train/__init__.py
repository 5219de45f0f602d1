"""Context-parallel training on ``torch.distributed`` alone (no Ray, no pydantic): runs under
torchrun or inside Ray workers.

    from ringray.train import Trainer, TrainOptions, run_training

- :mod:`~ringray.train.options`: one options dataclass per job-spec section, composed into
  :class:`TrainOptions`.
- :mod:`~ringray.train.mesh`: the dp × cp mesh; :mod:`~ringray.train.trainer`: one step.
- :mod:`~ringray.train.sharding`: replicated weights, or FSDP2 over the flattened mesh;
  :mod:`~ringray.train.footprint`: the memory one rank holds, term by term.
- :mod:`~ringray.train.checkpoint`: DCP checkpoints committed by a marker.
- :mod:`~ringray.train.step_stats`: what a step measured.
- :mod:`~ringray.train.session`: one training session (restore, step, checkpoint, evaluate on
  every rank), the one both drivers run: :mod:`~ringray.train.loop` (torchrun) and the Ray
  workers; :mod:`~ringray.train.run_dir`: the run directory's single writer (lock,
  ``steps.jsonl``, ``passkey.json``).
- ``python -m ringray.train --config FILE``: the torchrun entry point.
"""

from ringray.train.checkpoint import CheckpointRef, CheckpointStore
from ringray.train.loop import RunResult, run_training
from ringray.train.mesh import Mesh, MeshShape, build_mesh, resolve_mesh_shape
from ringray.train.options import (
    CheckpointOptions,
    EvalOptions,
    OptimizerOptions,
    ParallelOptions,
    TrainingOptions,
    TrainOptions,
)
from ringray.train.run_dir import RunDirectory
from ringray.train.session import (
    NonFiniteSteps,
    NonFiniteWeights,
    Restored,
    Saved,
    TrainingSession,
    checkpoint_due,
    plan_session,
)
from ringray.train.step_stats import StepStats
from ringray.train.trainer import Trainer

__all__ = [
    "CheckpointOptions",
    "CheckpointRef",
    "CheckpointStore",
    "EvalOptions",
    "Mesh",
    "MeshShape",
    "NonFiniteSteps",
    "NonFiniteWeights",
    "OptimizerOptions",
    "ParallelOptions",
    "Restored",
    "RunDirectory",
    "RunResult",
    "Saved",
    "StepStats",
    "TrainOptions",
    "Trainer",
    "TrainingOptions",
    "TrainingSession",
    "checkpoint_due",
    "plan_session",
    "build_mesh",
    "resolve_mesh_shape",
    "run_training",
]
