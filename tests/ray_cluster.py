"""A real multi-node Ray cluster on this machine for the service tests, and job helpers.

Every node is a real raylet (``ray.cluster_utils.Cluster``); ``remove_node`` kills one for
real. The GCS health checks run every second with a threshold of 3, so a killed node is
marked dead in about 3 s (about 15 s with Ray's defaults).

Each test adds its own worker nodes offering a resource named after the test, so its job
can only land there, and removes them when it ends; the module's cluster is shut down by
the `local_cluster` fixture (tests/conftest.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import ray
from progress import prompt
from ray.cluster_utils import Cluster
from train_cases import changed, tiny_options

from ringray.cluster.driver import release, start_controller
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.status import JobStatus
from ringray.metrics import MetricsOptions
from ringray.train import TrainOptions

HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


class LocalCluster:
    """A head node without worker slots, plus the worker nodes tests add."""

    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False,
                            "_system_config": HEALTH_CHECKS},
        )
        self.nodes: list = []
        ray.init(address=self.cluster.address, namespace="ringray")

    def add_node(self, tag: str, *, slots: int, labels: dict[str, str] | None = None):
        """A node with ``slots`` worker slots for jobs whose workers ask for ``tag``."""
        node = self.cluster.add_node(num_cpus=slots, resources={tag: slots},
                                     labels=labels or {})
        self.cluster.wait_for_nodes()
        self.nodes.append(node)
        return node

    def remove_node(self, node, *, graceful: bool = False) -> None:
        """Kill the node's raylet and every process on it."""
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.nodes.remove(node)

    def drain_node(self, node, *, deadline_seconds: float) -> None:
        """A preemption notice: the GCS marks the node draining, to be gone in
        ``deadline_seconds`` (what a cloud's spot interruption turns into; Ray's own
        ``ray drain-node`` makes the same call)."""
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(address=self.cluster.address)
        accepted, why = gcs.drain_node(
            node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "test: spot preemption", int((time.time() + deadline_seconds) * 1000),
        )
        assert accepted, why

    def remove_all(self) -> None:
        for node in list(self.nodes):
            self.remove_node(node, graceful=True)

    def shutdown(self) -> None:
        self.remove_all()
        ray.shutdown()
        self.cluster.shutdown()


def stop_processes_under(directory: str) -> None:
    """Stop one Ray cluster started with ``ray start --temp-dir=directory`` (or an embedded
    Ray under ``RAY_TMPDIR=directory``): SIGKILL the processes whose command line names that
    directory (Ray starts its processes with paths under it) and those whose working
    directory or open files lie under it (Ray's agents and workers rename themselves, e.g.
    ``ray::DashboardAgent``, so their command line no longer names it). Nothing else on the
    machine is touched (never ``ray stop --force``)."""
    mine = []
    for proc in Path("/proc").glob("[0-9]*"):
        if int(proc.name) == os.getpid():
            continue
        try:
            if directory.encode() in (proc / "cmdline").read_bytes():
                mine.append(int(proc.name))
                continue
            links = [proc / "cwd", *(proc / "fd").iterdir()]
            if any(str(link.readlink()).startswith(directory) for link in links):
                mine.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    for pid in mine:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in mine) and time.monotonic() < deadline:
        time.sleep(0.1)


def job_options(run_dir: str, **sections: dict) -> TrainOptions:
    """The tiny two-layer model on a ring of 2, 64-token sequences, a checkpoint every 4
    steps; ``sections`` as for ``tiny_options``."""
    base = tiny_options(run_dir, parallel={"cp": 2}, train={"steps": 12},
                        checkpoint={"interval": 4, "keep": 10})
    return changed(base, **sections)


def cluster_options(tag: str, **overrides) -> ClusterOptions:
    """Workers that ask for ``tag`` (only this test's nodes offer it), short timeouts; the
    startup's stretches with the machine's load (a loaded CI machine starts Ray workers that
    much slower: 90 s on a quiet one failed an autoscaling test at a load of 5 on 2 cores)."""
    base = ClusterOptions(
        worker_resources={"CPU": 1.0, tag: 1.0},
        step_timeout_seconds=60, startup_timeout_seconds=prompt(90), capacity_wait_seconds=30,
        poll_seconds=0.2, request_resources=False,
    )
    return replace(base, **overrides)


def start_job(name: str, train: TrainOptions, cluster: ClusterOptions, *,
              metrics: MetricsOptions | None = None):
    """A new job's controller (no metrics endpoint unless ``metrics`` asks for one)."""
    job = JobOptions(name=name, train=train, cluster=cluster,
                     metrics=metrics or MetricsOptions(port=None))
    controller, reattached = start_controller(job)
    assert not reattached
    return controller


def status_of(controller) -> JobStatus:
    return ray.get(controller.status.remote())


def wait_until(
    controller, condition: Callable[[JobStatus], bool], *, timeout: float, what: str
) -> JobStatus:
    """Poll the job's status until ``condition`` holds; fail (showing the status) if the job
    ends first, or after ``timeout`` seconds (stretched by the load, ``prompt``) in which it
    made no progress: no new step and no new event. A loaded machine makes every step slower;
    a job that keeps moving is waited for."""
    seen, since = None, time.monotonic()
    while True:
        status = status_of(controller)
        if condition(status):
            return status
        progress = (status.step, len(status.events))
        if progress != seen:
            seen, since = progress, time.monotonic()
        if status.done or time.monotonic() - since > prompt(timeout):
            events = "\n".join(f"  [{e.state}] {e.message}" for e in status.events)
            raise AssertionError(
                f"waiting for {what}: job {status.state} at step {status.step} "
                f"(error: {status.error})\n{events}"
            )
        time.sleep(0.2)


def finish(controller, *, timeout: float = 240) -> JobStatus:
    status = wait_until(controller, lambda s: s.done, timeout=timeout, what="the job to end")
    release(controller)
    return status
