"""A job at its advertised scale, simulated in one process: the mesh and FSDP's shards of one
rank of a 64-GPU job, built on the ``meta`` device over a fake process group.

    report = simulate_rank(options, world_size=64, rank=63)   # in a fresh process

Nothing is allocated and nothing is sent: ``torch.distributed``'s fake backend (PyTorch's own
testing backend) answers every collective at once, and every tensor lives on ``meta``. What
comes out is what a real rank would hold: its coordinates and group sizes in the named device
mesh, the local shape of each FSDP shard (``fully_shard`` pads dim 0 to a multiple of the
shard count, so the last ranks may hold fewer rows), and the bytes of its float32 weights,
gradients and AdamW moments, to set against :func:`ringray.train.footprint.rank_footprint`
(the memory model ``ringray plan`` uses). Activations are not simulated: on ``meta`` nothing
is computed. (A rank's whole step does run over the fake backend on a real device, with
received blocks left unfilled: ``tests/test_gpu_train_sync.py`` checks a ring rank's step for
host synchronisations that way.)

It initialises ``torch.distributed`` for the process, so it is meant for a process of its own
(``ringray plan --simulate`` or a test's subprocess).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringray.model import Transformer
from ringray.train.mesh import MeshShape, build_mesh, resolve_mesh_shape
from ringray.train.options import TrainOptions
from ringray.train.sharding import shard_model


@dataclass(frozen=True, kw_only=True)
class SimulatedRank:
    """One rank of a simulated job."""

    rank: int
    world_size: int
    dp_rank: int
    cp_rank: int
    group_sizes: dict[str, int]
    """Ranks in each of this rank's groups (dp, ring, ulysses, cp, fsdp)."""
    shard_shapes: dict[str, tuple[int, ...]]
    """Each parameter's local shard shape on this rank (its full shape when replicated)."""
    local_params: int
    """Parameters this rank holds (the elements of its shards)."""

    @property
    def weights_bytes(self) -> int:
        return 4 * self.local_params  # float32 master weights

    @property
    def optimizer_bytes(self) -> int:
        return 8 * self.local_params  # AdamW's two float32 moments


def simulate_rank(options: TrainOptions, *, world_size: int, rank: int) -> SimulatedRank:
    """Build ``options``' model on ``meta`` and shard it as rank ``rank`` of ``world_size``
    would (FSDP over the flattened mesh when ``parallel.fsdp``), over the fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulate_rank: torch.distributed is already initialised in this "
                           "process; run the simulation in a process of its own")
    parallel = options.parallel
    shape: MeshShape = resolve_mesh_shape(world_size=world_size, dp=parallel.dp,
                                          cp=parallel.cp, ulysses=parallel.ulysses)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = build_mesh(shape)
        with torch.device("meta"):
            model = Transformer(options.model)
        if parallel.fsdp and shape.world_size > 1:
            shard_model(model, mesh.fsdp_mesh, param_dtype=torch.bfloat16)
        shapes = {name: tuple(_local(p).shape) for name, p in model.named_parameters()}
        groups = {"dp": mesh.dp_group, "ring": mesh.ring_group, "ulysses": mesh.ulysses_group,
                  "cp": mesh.cp_group, "fsdp": mesh.fsdp_mesh.get_group()}
        return SimulatedRank(
            rank=rank, world_size=world_size, dp_rank=mesh.dp_rank, cp_rank=mesh.cp_rank,
            group_sizes={name: dist.get_world_size(g) if g is not None else 1
                         for name, g in groups.items()},
            shard_shapes=shapes,
            local_params=sum(_local(p).numel() for p in model.parameters()),
        )
    finally:
        dist.destroy_process_group()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param
