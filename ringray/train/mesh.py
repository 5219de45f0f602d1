"""The data-parallel × context-parallel mesh, its cp dimension a ring × Ulysses grid.

    shape = resolve_mesh_shape(world_size=8, dp=2, cp=None)   # cp inferred: 4
    shape = resolve_mesh_shape(world_size=8, dp=2, cp=4, ulysses=2)  # ring 2 × ulysses 2
    mesh = build_mesh(shape, device_type="cpu")                # needs torch.distributed

One ``DeviceMesh`` with named dimensions ``("dp", "ring", "ulysses")`` holds every group a
rank uses: the ring, the Ulysses group and the data-parallel group are its dimensions, the
``cp`` group (ring × ulysses) and FSDP's mesh (every dimension) are flattened from it. Every
group gets the default group's timeout, the job's collective timeout (``init_device_mesh``
would give each the backend's default; :mod:`ringray.attention.groups`), and the ring's group
(the ``ring`` dimension, which carries the K/V exchange) NCCL's high-priority stream.

Ranks are laid out as ``arange(world).view(dp, ring, ulysses)``: global rank = dp_index × cp
+ ring_index × ulysses + ulysses_index, with cp = ring × ulysses. The ``cp`` ranks of one
dp index share each sequence (consecutive ranks, so they stay on as few nodes as possible);
a column over dp is one data-parallel group. Inside the cp ranks, a run of ``ulysses``
consecutive ranks is one Ulysses group (one node: its all-to-all wants fast links) and the
ranks that share an ulysses index are one ring (the layout's convention,
:func:`ringray.attention.make_layout` with ``ulysses=``). With ``ulysses`` 1 the ring is the
whole cp group and there is no Ulysses group. Gradients are summed over the whole mesh:
weights are replicated everywhere, or, with ``parallel.fsdp``, sharded over the whole mesh
flattened (rank order is already the flattened dp × cp order; :mod:`ringray.train.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ringray.attention.groups import (
    RING_DIM,
    GroupOptions,
    backend_options,
    group_timeout,
    mesh_group_options,
    mesh_override,
)


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    dp: int
    cp: int  # ranks per sequence: ring × ulysses
    ulysses: int = 1

    def __post_init__(self) -> None:
        if self.ulysses < 1 or self.cp % self.ulysses:
            raise ValueError(f"parallel.ulysses: {self.ulysses} does not divide cp={self.cp}; "
                             f"use a divisor of {self.cp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def ring(self) -> int:
        """Ranks of one ring: cp / ulysses."""
        return self.cp // self.ulysses

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, cp_rank)`` of a global rank."""
        return divmod(rank, self.cp)

    def grid_coords(self, cp_rank: int) -> tuple[int, int]:
        """``(ring_index, ulysses_index)`` of a rank's index within its cp ranks."""
        return divmod(cp_rank, self.ulysses)


def resolve_mesh_shape(*, world_size: int, dp: int | None, cp: int | None,
                       ulysses: int = 1) -> MeshShape:
    """Fill in at most one missing degree from the world size and check the product (and
    that ``ulysses`` divides cp, inferred or given).

    Raises:
        ValueError: showing the arithmetic when the degrees do not multiply out.
    """
    for name, degree in (("dp", dp), ("cp", cp), ("ulysses", ulysses)):
        if degree is not None and degree < 1:
            raise ValueError(f"parallel.{name}: must be >= 1, got {degree}")
    if dp is None and cp is None:
        dp = 1
    if cp is None:
        if world_size % dp:
            raise ValueError(
                f"parallel.cp: cannot infer cp = world size / dp = {world_size} / {dp}: "
                f"not a whole number; give parallel.dp a divisor of {world_size} "
                f"({_divisors(world_size)}) or run on a multiple of {dp} ranks"
            )
        cp = world_size // dp
    elif dp is None:
        if world_size % cp:
            raise ValueError(
                f"parallel.dp: cannot infer dp = world size / cp = {world_size} / {cp}: "
                f"not a whole number; give parallel.cp a divisor of {world_size} "
                f"({_divisors(world_size)}) or run on a multiple of {cp} ranks"
            )
        dp = world_size // cp
    if dp * cp != world_size:
        raise ValueError(
            f"parallel: dp × cp must equal the world size: {dp} × {cp} = {dp * cp}, "
            f"but the world has {world_size} rank(s)"
        )
    if cp % ulysses:
        raise ValueError(
            f"parallel.ulysses: {ulysses} does not divide cp = {cp} (cp = ring × ulysses); use "
            f"a divisor of {cp}"
        )
    return MeshShape(dp=dp, cp=cp, ulysses=ulysses)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


MESH_DIMS = ("dp", RING_DIM, "ulysses")
"""The named dimensions of the job's device mesh, outermost first (rank-major order)."""
CP_DIM = "cp"
"""The flattened ring × ulysses dimension: every rank of this rank's sequences."""
FSDP_DIM = "dp_shard_cp"
"""The flattened dp × cp dimension FSDP shards over (:mod:`ringray.train.sharding`)."""


def mesh_options(timeout: timedelta | None,
                 backend: str | None = None) -> dict[str, GroupOptions] | None:
    """What each dimension's groups are made with: ``timeout`` (the default group's) for
    every one, NCCL's high-priority stream for the ring's alone (``None`` in a simulation,
    where there is no timeout to carry)."""
    return mesh_group_options(MESH_DIMS, timeout, backend, high_priority=(RING_DIM,))


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """This rank's place in the mesh and its process groups (``None`` in a 1-process run).

    ``cp_group`` holds every rank of this rank's sequences; ``ring_group`` is the ring this
    rank's K/V blocks go round (``cp_group`` itself without Ulysses); ``ulysses_group`` the
    ranks it exchanges heads with (``None`` without Ulysses, ``parallel.ulysses`` 1);
    ``device_mesh`` the named mesh they all come from and ``fsdp_mesh`` its flattening."""

    shape: MeshShape
    rank: int
    dp_rank: int
    cp_rank: int  # ring_index × ulysses + ulysses_index
    cp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None = None
    ulysses_group: dist.ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None
    fsdp_mesh: DeviceMesh | None = None
    timeout: timedelta | None = None
    """Every group's collective timeout (the default group's)."""

    @property
    def distributed(self) -> bool:
        return self.shape.world_size > 1


def build_mesh(shape: MeshShape, *, device_type: str = "cpu") -> Mesh:
    """The job's device mesh for ``shape`` on ``device_type`` ("cpu" for gloo, "cuda" for
    NCCL) and this rank's groups from it, each with the default group's timeout (every rank
    must call this, in step)."""
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
    timeout = group_timeout()
    override = backend_options(timeout)
    device_mesh = init_device_mesh(
        device_type, (shape.dp, shape.ring, shape.ulysses), mesh_dim_names=MESH_DIMS,
        backend_override=mesh_override(mesh_options(timeout)))
    cp_mesh = (device_mesh[RING_DIM] if shape.ulysses == 1
               else device_mesh[RING_DIM, "ulysses"]._flatten(CP_DIM, backend_override=override))
    fsdp_mesh = device_mesh[MESH_DIMS]._flatten(FSDP_DIM, backend_override=override)
    dp_rank, cp_rank = shape.coords(rank)
    cp_group = cp_mesh.get_group()
    return Mesh(
        shape=shape, rank=rank, dp_rank=dp_rank, cp_rank=cp_rank,
        cp_group=cp_group, dp_group=device_mesh.get_group("dp"),
        ring_group=device_mesh.get_group(RING_DIM) if shape.ulysses > 1 else cp_group,
        ulysses_group=device_mesh.get_group("ulysses") if shape.ulysses > 1 else None,
        device_mesh=device_mesh, fsdp_mesh=fsdp_mesh, timeout=timeout,
    )
