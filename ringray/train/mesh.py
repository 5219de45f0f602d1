"""The data-parallel × context-parallel mesh.

    shape = resolve_mesh_shape(world_size=8, dp=2, cp=None)   # cp inferred: 4
    mesh = build_mesh(shape)                                   # needs torch.distributed

Ranks are laid out as ``arange(world).view(dp, cp)``: a row is one context-parallel ring
(consecutive ranks, so a ring stays on as few nodes as possible), a column is one
data-parallel group. Gradients are summed over the whole mesh: weights are replicated
everywhere, or, with ``parallel.fsdp``, sharded over the whole mesh flattened (rank order is
already the flattened dp × cp order; :mod:`ringray.train.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    dp: int
    cp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, cp_rank)`` of a global rank."""
        return divmod(rank, self.cp)


def resolve_mesh_shape(*, world_size: int, dp: int | None, cp: int | None) -> MeshShape:
    """Fill in at most one missing degree from the world size and check the product.

    Raises:
        ValueError: showing the arithmetic when the degrees do not multiply out.
    """
    for name, degree in (("dp", dp), ("cp", cp)):
        if degree is not None and degree < 1:
            raise ValueError(f"parallel.{name}: must be >= 1, got {degree}")
    if dp is None and cp is None:
        dp = 1
    if cp is None:
        if world_size % dp:
            raise ValueError(
                f"parallel.cp: cannot infer cp = world size / dp = {world_size} / {dp}: "
                f"not a whole number"
            )
        cp = world_size // dp
    elif dp is None:
        if world_size % cp:
            raise ValueError(
                f"parallel.dp: cannot infer dp = world size / cp = {world_size} / {cp}: "
                f"not a whole number"
            )
        dp = world_size // cp
    if dp * cp != world_size:
        raise ValueError(
            f"parallel: dp × cp must equal the world size: {dp} × {cp} = {dp * cp}, "
            f"but the world has {world_size} rank(s)"
        )
    return MeshShape(dp=dp, cp=cp)


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """This rank's place in the mesh and its process groups (``None`` in a 1-process run)."""

    shape: MeshShape
    rank: int
    dp_rank: int
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    @property
    def distributed(self) -> bool:
        return self.shape.world_size > 1


def build_mesh(shape: MeshShape) -> Mesh:
    """Create the CP and DP groups for ``shape`` (every rank must call this, in step)."""
    if not (dist.is_available() and dist.is_initialized()):
        if shape.world_size != 1:
            raise ValueError(
                f"parallel: dp × cp = {shape.world_size} needs torch.distributed "
                f"(run under torchrun or Ray), but it is not initialised"
            )
        return Mesh(shape=shape, rank=0, dp_rank=0, cp_rank=0, cp_group=None, dp_group=None)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != shape.world_size:
        raise ValueError(
            f"parallel: dp × cp = {shape.dp} × {shape.cp} = {shape.world_size}, "
            f"but the world has {world} rank(s)"
        )
    grid = torch.arange(world).view(shape.dp, shape.cp)
    dp_rank, cp_rank = shape.coords(rank)
    cp_group = dp_group = None
    # new_group is collective: every rank creates every group, in the same order.
    for row in grid.tolist():
        group = dist.new_group(row)
        if rank in row:
            cp_group = group
    for column in grid.t().tolist():
        group = dist.new_group(column)
        if rank in column:
            dp_group = group
    return Mesh(
        shape=shape, rank=rank, dp_rank=dp_rank, cp_rank=cp_rank,
        cp_group=cp_group, dp_group=dp_group,
    )
