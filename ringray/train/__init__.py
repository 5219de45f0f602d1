"""Context-parallel training on ``torch.distributed`` alone (no Ray): runs under torchrun or
inside Ray workers.

    from ringray.train import Trainer, TrainOptions, run_training
"""

from ringray.train.checkpoint import CheckpointRef, CheckpointStore
from ringray.train.loop import RunResult, run_training
from ringray.train.mesh import Mesh, MeshShape, build_mesh, resolve_mesh_shape
from ringray.train.options import OptimizerOptions, PasskeyEvalOptions, TrainOptions
from ringray.train.stats import StepStats
from ringray.train.trainer import Trainer

__all__ = [
    "CheckpointRef",
    "CheckpointStore",
    "Mesh",
    "MeshShape",
    "OptimizerOptions",
    "PasskeyEvalOptions",
    "RunResult",
    "StepStats",
    "TrainOptions",
    "Trainer",
    "build_mesh",
    "resolve_mesh_shape",
    "run_training",
]
