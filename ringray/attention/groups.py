"""Process groups that time out when the job says, not when the backend's default does.

    timeout = group_timeout()                     # the default group's (what the job joined with)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("ring", "ulysses"),
                            backend_override=with_timeout(mesh_dims, timeout))

``torch.distributed.new_group`` (and so ``init_device_mesh``, which calls it per dimension)
gives a new group the *backend's* default timeout (gloo 30 minutes, NCCL 10), not the timeout
the default group was created with. A job that joins with a collective timeout of, say,
twice its step timeout would still wait half an hour on a dead peer in every subgroup. Every
group ringray creates therefore passes the default group's timeout explicitly.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

BackendOverride = tuple[str, object]  # (backend name, its Options carrying the timeout)


def _backend_device(group: dist.ProcessGroup) -> torch.device:
    name = dist.get_backend(group)
    return torch.device("cuda" if name == "nccl" else "cpu")


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The timeout of ``group``'s collectives (``None``: the default group's)."""
    group = group if group is not None else dist.group.WORLD
    # The only public place a group's timeout is kept is its backend's options.
    return group._get_backend(_backend_device(group)).options._timeout


def backend_options(timeout: timedelta, backend: str | None = None) -> BackendOverride:
    """``(backend, options)`` for ``new_group``/``init_device_mesh`` that carry ``timeout``
    (``backend`` defaults to the default group's: gloo or nccl)."""
    backend = backend or dist.get_backend()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        raise ValueError(f"backend: {backend!r} is not one ringray sets timeouts on; "
                         f"valid: 'gloo', 'nccl'")
    options._timeout = timeout
    return backend, options


def with_timeout(dims: Iterable[str], timeout: timedelta) -> dict[str, BackendOverride]:
    """``init_device_mesh``'s ``backend_override`` giving every dimension ``timeout``."""
    override = backend_options(timeout)
    return {dim: override for dim in dims}
