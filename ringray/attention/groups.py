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


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout of ``group``'s collectives (``None``: the default group's); ``None`` for a
    backend that keeps none (the fake process group of a simulation)."""
    group = group if group is not None else dist.group.WORLD
    # The only place a group's timeout is kept is its backend's options.
    options = getattr(group._get_backend(_backend_device(group)), "options", None)
    return options._timeout if options is not None else None


def backend_options(timeout: timedelta | None,
                    backend: str | None = None) -> BackendOverride | None:
    """``(backend, options)`` for ``new_group``/``init_device_mesh`` that carry ``timeout``
    (``backend`` defaults to the default group's: gloo or nccl); ``None`` (the backend's
    own groups) when there is no timeout to carry, in a simulation."""
    backend = backend or dist.get_backend()
    if timeout is None:
        return None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        raise ValueError(f"backend: {backend!r} is not one ringray sets timeouts on; "
                         f"valid: 'gloo', 'nccl'")
    options._timeout = timeout
    return backend, options


def with_timeout(dims: Iterable[str],
                 timeout: timedelta | None) -> dict[str, BackendOverride] | None:
    """``init_device_mesh``'s ``backend_override`` giving every dimension ``timeout``."""
    override = backend_options(timeout)
    return None if override is None else {dim: override for dim in dims}
