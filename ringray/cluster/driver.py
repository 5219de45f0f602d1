"""The driver's side of a job: connect to Ray, start (or reattach to) the controller, follow it.

    connect(address=None, local_cpus=4)            # None: an embedded single-node Ray
    controller, reattached = start_controller(job_options)      # a JobOptions
    final = follow(controller, on_status=print)    # a JobStatus once the job has ended
    release(controller)

The controller is a detached actor named after the job (``ringray-job-<name>`` in the
``ringray`` namespace) and pinned to the head node, so it outlives the driver that started it
and a worker node's death never takes it down. Starting a job whose controller is still
running reattaches to it instead of starting a second one.

An embedded Ray's processes (its GCS, raylet and the workers they start) run with SIGTERM
blocked, as Ray itself blocks SIGINT in them: a SIGTERM sent to the whole process group
(``timeout``) or to every process of a service (systemd's default ``KillMode``) then reaches
only the driver, which stops the job as for Ctrl-C (checkpoint, stop, release the run
directory) instead of losing Ray, and the job's lock, under it. They are killed outright when
the driver exits (:func:`connect` arranges it).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import ray

from ringray.cluster.controller import JobController
from ringray.cluster.job_options import JobOptions, job_differences
from ringray.cluster.nodes import HEAD_NODE_RESOURCE
from ringray.cluster.status import JobStatus

NAMESPACE = "ringray"
# Ray's built-in resource on the head node: a sliver of it pins the controller there.
PROBE_SECONDS = 5.0
"""How long :func:`connect` waits for a TCP answer at a cluster's address before giving up
(Ray's own connection attempts go on for minutes without a word)."""


class RayUnavailable(ConnectionError):
    """Ray cannot be reached at an address, or an embedded Ray does not start (one line)."""


def controller_name(job_name: str) -> str:
    return f"ringray-job-{job_name}"


def connect(address: str | None, *, local_cpus: int) -> bool:
    """Connect to the Ray cluster at ``address`` (``auto``, ``host:port``, ``ray://…``), or
    start an embedded single-node Ray with ``local_cpus`` logical CPUs when it is ``None``.
    Returns whether Ray is embedded (it ends with this process).

    The caller's SIGTERM handler stays in place (``ray.init`` installs one that exits at
    once).

    Raises:
        RayUnavailable: nothing answers at ``address`` within :data:`PROBE_SECONDS`, Ray
            refuses the connection, or an embedded Ray does not start (a loaded machine can
            time it out); one line.
    """
    if ray.is_initialized():
        return False
    common = {"namespace": NAMESPACE, "logging_level": logging.WARNING, "log_to_driver": False}
    if address is not None:
        _probe(address)
    handler = signal.getsignal(signal.SIGTERM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if address is None \
        else None
    try:
        if address is None:
            # "local": always a new Ray of our own, even when another one runs on this machine.
            ray.init(address="local", num_cpus=local_cpus, include_dashboard=False, **common)
            atexit.register(_shutdown_embedded)
        else:
            ray.init(address=address, **common)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, plain Exception...
        what = "cannot start a local Ray" if address is None else "cannot connect to Ray"
        raise RayUnavailable(f"{what} ({_first_line(exc)})") from exc
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
        if blocked is not None:  # a SIGTERM that came meanwhile is handled now, by the caller
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return address is None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _probe(address: str) -> None:
    """Raise :class:`RayUnavailable` unless something answers a TCP connection at the
    ``host:port`` that ``address`` names (``auto``: the cluster this machine last started)."""
    target = address
    if address == "auto":
        try:  # Ray's own lookup ($RAY_ADDRESS, the address file of `ray start`); private
            target = ray._private.services.canonicalize_bootstrap_address("auto")
        except Exception:
            return  # ray.init reports what it finds
        if target is None:
            return
    host, sep, port = target.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port; ray.init reports it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS):
            return
    except TimeoutError:
        why = f"no answer within {PROBE_SECONDS:.0f} s"
    except socket.gaierror as exc:
        why = f"unknown host ({exc.strerror})"
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
    where = f" (from {address})" if target != address else ""
    raise RayUnavailable(f"nothing answers at {host}:{port}{where}: {why}; is a Ray cluster "
                         f"running there? (`ray start --head` starts one and prints its "
                         f"address)")


def _shutdown_embedded() -> None:
    """End this process's embedded Ray at once. Its processes do not take SIGTERM (see the
    module's docstring), so Ray's own shutdown would wait a second on each before killing it;
    they are killed outright instead. The job has ended (or been given up) by then."""
    import ray._private.worker as ray_worker  # Ray has no public way to skip that wait

    node = getattr(ray_worker, "_global_node", None)
    if node is None or not hasattr(node, "kill_all_processes"):
        return  # Ray's own exit hook shuts it down
    ray_worker._global_node = None  # ray.shutdown() disconnects and leaves the processes
    try:
        ray.shutdown()
    finally:
        raylet = getattr(node, "all_processes", {}).get("raylet") or []
        for info in raylet:  # its agents and workers first: without a raylet (and a GCS to
            _kill_children(info.process.pid)  # report to) an agent lingers for a minute
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


def _kill_children(parent_pid: int) -> None:
    """SIGKILL the processes whose parent is ``parent_pid`` (Linux: read from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent_pid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def find_controller(job_name: str):
    """The running controller of ``job_name``, or ``None``."""
    try:
        return ray.get_actor(controller_name(job_name), namespace=NAMESPACE)
    except ValueError:
        return None


class JobChanged(ValueError):
    """A job of this name runs from another job file (one line naming the fields)."""


class ControllerLost(RuntimeError):
    """The job's controller died while it was followed."""


def start_controller(job: JobOptions) -> tuple[object, bool]:
    """The job's controller, started (or reattached when one is still running): the handle
    and whether it was a reattachment. A controller of the same name whose job has ended is
    replaced."""
    existing = find_controller(job.name)
    if existing is not None:
        status: JobStatus = ray.get(existing.status.remote())
        if not status.done:
            changed = job_differences(ray.get(existing.job_options.remote()), job)
            if changed:
                raise JobChanged(
                    f"job {job.name!r} is running on this cluster from another job file "
                    f"({'; '.join(changed)}); follow it with the same job file, stop it "
                    f"(ringray stop {job.name}) and start again, or give this job another "
                    f"name")
            return existing, True
        ray.kill(existing)
    handle = ray.remote(JobController).options(
        name=controller_name(job.name), namespace=NAMESPACE, lifetime="detached",
        max_concurrency=4,  # status() and stop() answer while the machine's thread works
        num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001}, max_restarts=0,
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
    """Call ``on_status`` with the job's status every ``poll_seconds`` until the job ends.

    Raises:
        ControllerLost: the controller died (its node was lost, or it was killed); one line.
    """
    while True:
        try:
            status = job_status(controller)
        except ray.exceptions.RayActorError as exc:
            raise ControllerLost(
                f"the job's controller died ({type(exc).__name__}: its node was lost or it "
                f"was killed); the last committed checkpoint stays, and ringray train with "
                f"the same job file resumes from it") from None
        on_status(status)
        if status.done:
            return status
        time.sleep(poll_seconds)


def release(controller) -> None:
    """Remove an ended job's controller (its status is gone with it)."""
    ray.kill(controller)
