"""The recovery benchmark's cluster on real hosts (``python benchmarks/recovery.py --hosts``).

:func:`host_cluster` is :func:`recovery_common.local_cluster` on hosts of their own
(``tests/hosts.py``: network, UTS and mount namespaces on a bridge, 198.18.0.0/15): the head
and each worker node on a host with its own address and a host name nobody resolves, and a
spare host per replacement. The benchmark's own main thread joins the head host's network
namespace (``setns``) before it connects, so the driver, the controller's calls and Ray
Train's run as they would on the head node. A node's "death" is either ``kill`` (every
process of its host, at once) or ``partition`` (its link cut: the host lives on, unreachable;
Ray's health checks, each timed out after 1 s, declare it dead).

Needs root. The same :class:`BenchNodes` interface as the local cluster's, so both systems'
measurements run unchanged.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ray
from recovery_common import SLOT_RESOURCE

from ringray.cluster.driver import NAMESPACE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hosts import Host, Hosts, hosts_unavailable  # noqa: E402

FAULTS = ("kill", "partition")
_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    """Move this thread (the main thread: threads and processes made after it follow) into
    the network namespace open at ``fd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns: cannot change the network namespace")


@dataclass
class HostNode:
    node_id: str
    host: Host


class HostNodes:
    """The worker nodes of a cluster on hosts; add, kill or cut them from the main thread."""

    def __init__(self, hosts: Hosts, slots_per_node: int, fault: str, log_dir: Path) -> None:
        self.hosts, self.slots_per_node, self.fault = hosts, slots_per_node, fault
        self.log_dir = log_dir
        self.nodes: list[HostNode] = []
        self._free = list(hosts.hosts[1:])

    def _node_id(self, host: Host, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for node in ray.nodes():
                if node["Alive"] and node["NodeManagerAddress"] == host.address:
                    return node["NodeID"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host.name}'s Ray node did not join")
            time.sleep(0.2)

    def start(self, count: int, *, head_cpus: int) -> None:
        """Ray on the head and on ``count`` worker hosts (before the driver connects)."""
        hosts = self._free[:count]
        self.hosts.start_ray(slots={h.index: self.slots_per_node for h in hosts},
                             resources={h.index: {SLOT_RESOURCE: self.slots_per_node}
                                        for h in hosts}, log_dir=self.log_dir,
                             head_cpus=head_cpus)
        self._free = self._free[count:]
        self._starting = hosts

    def connected(self) -> None:
        for host in self._starting:
            self.nodes.append(HostNode(self._node_id(host), host))

    def add(self) -> HostNode:
        host = self._free.pop(0)
        self.hosts.start_worker(host, slots=self.slots_per_node,
                                resources={SLOT_RESOURCE: self.slots_per_node},
                                log_dir=self.log_dir)
        node = HostNode(self._node_id(host), host)
        self.nodes.append(node)
        return node

    def by_id(self, node_id: str) -> HostNode:
        return next(node for node in self.nodes if node.node_id == node_id)

    def kill_and_replace(self, node: HostNode, *, replace: bool = True) -> float:
        """Kill or cut off ``node``'s host and, with ``replace``, start a node on a spare
        host; returns the wall time just before the fault."""
        at = time.time()
        if self.fault == "kill":
            node.host.kill()
        else:
            node.host.partition()
        self.nodes.remove(node)
        if replace:
            self.add()
        return at


@contextmanager
def host_cluster(*, slots_per_node: int, worker_nodes: int = 2, head_cpus: int = 0,
                 fault: str = "kill", log_dir: Path) -> Iterator[HostNodes]:
    """A head host (``head_cpus`` CPUs) and ``worker_nodes`` worker hosts, plus one spare
    host for a replacement; the driver connected from the head host; always removed."""
    why = hosts_unavailable()
    if why:
        raise RuntimeError(why)
    if fault not in FAULTS:
        raise ValueError(f"fault: {fault!r}; valid: {', '.join(FAULTS)}")
    with Hosts(1 + worker_nodes + 1) as hosts:
        nodes = HostNodes(hosts, slots_per_node, fault, log_dir)
        nodes.start(worker_nodes, head_cpus=head_cpus)
        own = os.open("/proc/self/ns/net", os.O_RDONLY)
        head = os.open(f"/proc/{hosts.head.anchor.pid}/ns/net", os.O_RDONLY)
        try:
            _setns(head)
            ray.init(address=hosts.ray_address, namespace=NAMESPACE,
                     logging_level=logging.WARNING, log_to_driver=False)
            nodes.connected()
            yield nodes
        finally:
            ray.shutdown()
            _setns(own)
            os.close(own)
            os.close(head)
