"""Context-parallel training on ``torch.distributed`` alone (no Ray, no pydantic): runs under
torchrun or inside Ray workers.

    from ringray.train import Trainer, TrainOptions, run_training

- :mod:`~ringray.train.options`: one options dataclass per job-spec section, composed into
  :class:`TrainOptions`.
- :mod:`~ringray.train.mesh`: the dp × cp mesh; :mod:`~ringray.train.trainer`: one step.
- :mod:`~ringray.train.sharding`: replicated weights, or FSDP2 over the flattened mesh;
  :mod:`~ringray.train.footprint`: the memory one rank holds, term by term.
- :mod:`~ringray.train.checkpoint`: DCP checkpoints committed by a marker.
- :mod:`~ringray.train.step_stats`: what a step measured; :mod:`~ringray.train.loop`: a run.
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
from ringray.train.step_stats import StepStats
from ringray.train.trainer import Trainer

__all__ = [
    "CheckpointOptions",
    "CheckpointRef",
    "CheckpointStore",
    "EvalOptions",
    "Mesh",
    "MeshShape",
    "OptimizerOptions",
    "ParallelOptions",
    "RunResult",
    "StepStats",
    "TrainOptions",
    "Trainer",
    "TrainingOptions",
    "build_mesh",
    "resolve_mesh_shape",
    "run_training",
]
