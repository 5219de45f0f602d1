"""Which devices and network interface each worker uses, decided as Ray Train decides them.

    places = [worker.devices() for worker in workers]     # what each worker reports
    setups = plan_devices(places)                         # pure: one DeviceSetup per rank
    worker.set_up_devices(setups[rank])                   # before the process group forms

Ray gives an actor that asks for one GPU only that GPU (``CUDA_VISIBLE_DEVICES`` of one id).
Ray Train instead shows each worker every GPU its job holds on the node and has it pick its
own by local rank, so NCCL sees the node's devices (peer access over NVLink/NVSwitch; setups
with one visible GPU per process are linked to NCCL faults on H100 NVSwitch nodes). ringray
does the same: the workers of a node share ``CUDA_VISIBLE_DEVICES`` (the sorted union of their
GPU ids) and each sets its device to the position of its own GPU in that list, in every call
that touches CUDA (actors are threaded, and the current device is per thread).

Collective traffic leaves by the interface that holds the node's address: ``NCCL_SOCKET_IFNAME``
and ``GLOO_SOCKET_IFNAME`` are set to it unless the user set them (gloo otherwise resolves the
host name, which on many clusters gives a loopback or an unroutable address).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SOCKET_IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True, kw_only=True)
class WorkerPlace:
    """What a worker reports about where it runs."""

    node_id: str
    gpu_ids: tuple[str, ...]  # the GPUs Ray assigned it (none on CPU)
    interface: str | None  # the network interface holding its node's address


@dataclass(frozen=True, kw_only=True)
class DeviceSetup:
    """What one worker sets before its process group forms."""

    visible_devices: str | None
    """``CUDA_VISIBLE_DEVICES`` (the job's GPUs on this node), or ``None`` on CPU."""
    local_rank: int
    """The worker's device index within ``visible_devices`` (0 on CPU)."""
    interface: str | None
    """``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` unless the user set them."""


def _gpu_order(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), gpu_id) if gpu_id.isdigit() else (1 << 30, gpu_id)


def plan_devices(places: Sequence[WorkerPlace]) -> list[DeviceSetup]:
    """One setup per worker (in rank order): a node's workers see all of the job's GPUs on
    that node, each using the one Ray gave it."""
    node_gpus: dict[str, list[str]] = {}
    for place in places:
        node_gpus.setdefault(place.node_id, []).extend(place.gpu_ids)
    visible = {node: sorted(set(ids), key=_gpu_order) for node, ids in node_gpus.items()}
    setups = []
    for place in places:
        gpus = visible[place.node_id]
        setups.append(DeviceSetup(
            visible_devices=",".join(gpus) if gpus else None,
            local_rank=gpus.index(place.gpu_ids[0]) if place.gpu_ids else 0,
            interface=place.interface,
        ))
    return setups


def interface_of(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The name of the interface holding ``address`` (``interfaces``: name → its addresses,
    as ``psutil.net_if_addrs`` lists them), or ``None``."""
    for name, addresses in interfaces.items():
        if address in addresses:
            return name
    return None


def socket_variables(setup: DeviceSetup, environment: Mapping[str, str]) -> dict[str, str]:
    """The interface variables to set: those the user has not set already."""
    if setup.interface is None:
        return {}
    return {name: setup.interface for name in SOCKET_IFNAME_VARIABLES if name not in environment}
