"""How ringray makes process groups: the default group's keyword arguments, and subgroups that
time out when the job says (not when the backend's default does), the ring's on a stream of
its own priority.

    dist.init_process_group(backend, timeout=timeout, **init_kwargs(backend, device))
    timeout = group_timeout()                     # the default group's (what the job joined with)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("ring", "ulysses"),
                            backend_override=with_timeout(mesh_dims, timeout,
                                                          high_priority=(RING_DIM,)))

The default group on NCCL is made with its rank's device (``device_id``): the communicator is
then created eagerly, at ``init_process_group``, and every subgroup is split from it
(``ncclCommSplit``) when it is made, instead of each being created lazily at its first
operation, when all of its ranks must take part. So the first ``batch_isend_irecv`` on a
ring needs only the ranks it names. Gloo groups are made as before.

``torch.distributed.new_group`` (and so ``init_device_mesh``, which calls it per dimension)
gives a new group the *backend's* default timeout (gloo 30 minutes, NCCL 10), not the timeout
the default group was created with. A job that joins with a collective timeout of, say,
twice its step timeout would still wait half an hour on a dead peer in every subgroup. Every
group ringray creates therefore passes the default group's timeout explicitly.

The ring's group (the ``ring`` dimension) gets NCCL's high-priority stream: its K/V sends
and receives must not queue behind attention kernels that fill every SM, or the transfer
stops hiding behind the compute. Other groups (data-parallel all-reduces, Ulysses) keep the
ordinary priority. A group's settings are first a plain :class:`GroupOptions` (tested on any
machine) and become the backend's own options object only when the group is made.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BackendOverride = tuple[str, object]  # (backend name, its Options carrying the timeout)

RING_DIM = "ring"
"""The mesh dimension whose groups carry the ring's K/V exchange (its NCCL stream is made
high-priority)."""

BACKENDS = ("gloo", "nccl")
"""The backends ringray makes groups on (the fake backend of a simulation aside)."""


def init_kwargs(backend: str, device: torch.device | None) -> dict[str, object]:
    """``init_process_group``'s keyword arguments for ``backend`` on this rank's ``device``
    beyond the backend, address and timeout: ``device_id`` for NCCL (eager communicator,
    subgroups split from it), nothing for gloo (or any other backend).

    Raises:
        ValueError: NCCL without a CUDA device (``torch.device("cuda", local_index)``).
    """
    if backend != "nccl":
        return {}
    if device is None or device.type != "cuda" or device.index is None:
        raise ValueError(f"device: NCCL needs this rank's CUDA device with its index, "
                         f"e.g. torch.device('cuda', local_rank); got {device}")
    return {"device_id": device}


def _backend_device(group: dist.ProcessGroup) -> torch.device:
    name = dist.get_backend(group)
    return torch.device("cuda" if name == "nccl" else "cpu")


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout of ``group``'s collectives (``None``: the default group's); ``None`` for a
    backend that keeps none (the fake process group of a simulation)."""
    group = group if group is not None else dist.group.WORLD
    # The only place a group's timeout is kept is its backend's options.
    options = getattr(group._get_backend(_backend_device(group)), "options", None)
    return options._timeout if options is not None else None


@dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """What a subgroup is made with, as plain data (:meth:`override` builds the backend's
    options object from it)."""

    backend: str
    """``"gloo"`` or ``"nccl"``."""
    timeout: timedelta
    """Every collective of the group fails after this long (the default group's)."""
    high_priority_stream: bool = False
    """NCCL: the group's operations run on a high-priority CUDA stream (the ring's). Gloo has
    no streams and ignores it."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: {self.backend!r} is not one ringray makes groups on; "
                             f"valid: {', '.join(repr(b) for b in BACKENDS)}")

    def override(self) -> BackendOverride:
        """``(backend, options)`` for ``new_group(backend=..., pg_options=...)`` and
        ``init_device_mesh``'s ``backend_override``."""
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = self.high_priority_stream
        else:
            options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        return self.backend, options


def group_options(timeout: timedelta | None, backend: str | None = None, *,
                  high_priority_stream: bool = False) -> GroupOptions | None:
    """A subgroup's :class:`GroupOptions` carrying ``timeout`` (``backend`` defaults to the
    default group's); ``None`` (the backend's own groups) when there is no timeout to carry,
    in a simulation."""
    if timeout is None:
        return None
    return GroupOptions(backend=backend or dist.get_backend(), timeout=timeout,
                        high_priority_stream=high_priority_stream)


def backend_options(timeout: timedelta | None, backend: str | None = None, *,
                    high_priority_stream: bool = False) -> BackendOverride | None:
    """``(backend, options)`` for ``new_group``/``init_device_mesh`` that carry ``timeout``
    (``backend`` defaults to the default group's: gloo or nccl); ``None`` (the backend's
    own groups) when there is no timeout to carry, in a simulation."""
    options = group_options(timeout, backend, high_priority_stream=high_priority_stream)
    return None if options is None else options.override()


def mesh_group_options(dims: Iterable[str], timeout: timedelta | None,
                       backend: str | None = None, *,
                       high_priority: Collection[str] = ()) -> dict[str, GroupOptions] | None:
    """Per mesh dimension, its groups' :class:`GroupOptions`: ``timeout`` for all, the
    high-priority stream for the dimensions in ``high_priority`` alone."""
    dims = tuple(dims)
    unknown = sorted(set(high_priority) - set(dims))
    if unknown:
        raise ValueError(f"high_priority: {unknown} are not dimensions of the mesh {dims}")
    if timeout is None:
        return None
    backend = backend or dist.get_backend()
    return {dim: GroupOptions(backend=backend, timeout=timeout,
                              high_priority_stream=dim in high_priority) for dim in dims}


def mesh_override(options: dict[str, GroupOptions] | None
                  ) -> dict[str, BackendOverride] | None:
    """``init_device_mesh``'s ``backend_override`` from :func:`mesh_group_options`."""
    return None if options is None else {dim: o.override() for dim, o in options.items()}


def with_timeout(dims: Iterable[str], timeout: timedelta | None, *,
                 high_priority: Collection[str] = ()) -> dict[str, BackendOverride] | None:
    """``init_device_mesh``'s ``backend_override`` giving every dimension ``timeout`` and
    the dimensions in ``high_priority`` (the ring's, :data:`RING_DIM`) NCCL's high-priority
    stream."""
    return mesh_override(mesh_group_options(dims, timeout, high_priority=high_priority))
