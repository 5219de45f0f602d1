"""The driver's side of a job: connect to Ray, start (or reattach to) the controller, follow it.

    connect(address=None, local_cpus=4)            # None: an embedded single-node Ray
    controller, reattached = start_controller(job_options)      # a JobOptions
    final = follow(controller, on_status=print)    # a JobStatus once the job has ended
    release(controller)

The controller is a detached actor named after the job (``ringray-job-<name>`` in the
``ringray`` namespace) and pinned to the head node, so it outlives the driver that started it
and a worker node's death never takes it down. Starting a job whose controller is still
running reattaches to it instead of starting a second one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

from ringray.cluster.controller import JobController
from ringray.cluster.job_options import JobOptions
from ringray.cluster.status import JobStatus

NAMESPACE = "ringray"
# Ray's built-in resource on the head node: a sliver of it pins the controller there.
_HEAD_NODE_RESOURCE = "node:__internal_head__"


def controller_name(job_name: str) -> str:
    return f"ringray-job-{job_name}"


def connect(address: str | None, *, local_cpus: int) -> bool:
    """Connect to the Ray cluster at ``address`` (``auto``, ``host:port``, ``ray://…``), or
    start an embedded single-node Ray with ``local_cpus`` logical CPUs when it is ``None``.
    Returns whether Ray is embedded (it ends with this process)."""
    if ray.is_initialized():
        return False
    common = {"namespace": NAMESPACE, "logging_level": logging.WARNING, "log_to_driver": False}
    if address is None:
        # "local": always a new Ray of our own, even when another one runs on this machine.
        ray.init(address="local", num_cpus=local_cpus, include_dashboard=False, **common)
        return True
    ray.init(address=address, **common)
    return False


def find_controller(job_name: str):
    """The running controller of ``job_name``, or ``None``."""
    try:
        return ray.get_actor(controller_name(job_name), namespace=NAMESPACE)
    except ValueError:
        return None


def start_controller(job: JobOptions) -> tuple[object, bool]:
    """The job's controller, started (or reattached when one is still running): the handle
    and whether it was a reattachment. A controller of the same name whose job has ended is
    replaced."""
    existing = find_controller(job.name)
    if existing is not None:
        status: JobStatus = ray.get(existing.status.remote())
        if not status.done:
            return existing, True
        ray.kill(existing)
    handle = ray.remote(JobController).options(
        name=controller_name(job.name), namespace=NAMESPACE, lifetime="detached",
        max_concurrency=4,  # status() and stop() answer while the machine's thread works
        num_cpus=0, resources={_HEAD_NODE_RESOURCE: 0.001}, max_restarts=0,
    ).remote(job)
    ray.get(handle.start.remote())
    return handle, False


def job_status(controller) -> JobStatus:
    return ray.get(controller.status.remote())


def request_stop(controller) -> str:
    """Ask the job to checkpoint at its next step boundary and stop; returns the state the
    job was in when the request arrived."""
    return ray.get(controller.stop.remote())


def follow(
    controller,
    *,
    on_status: Callable[[JobStatus], None],
    poll_seconds: float = 0.5,
) -> JobStatus:
    """Call ``on_status`` with the job's status every ``poll_seconds`` until the job ends."""
    while True:
        status = job_status(controller)
        on_status(status)
        if status.done:
            return status
        time.sleep(poll_seconds)


def release(controller) -> None:
    """Remove an ended job's controller (its status is gone with it)."""
    ray.kill(controller)
