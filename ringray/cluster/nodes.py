"""What the cluster looks like right now, read from Ray's control store (GCS).

    snapshots = schedulable_nodes(worker_resources={"GPU": 1}, avoid=set())
    alive = node_liveness()          # {node_id: bool}, dead nodes included
    drains = draining_nodes()        # {node_id: deadline in unix seconds, or None}

Liveness comes from the GCS's own health checks (``health_check_period_ms`` ×
``health_check_failure_threshold``: 3 s on the test clusters, about 15 s with Ray's defaults).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import ray

from ringray.cluster.placement import NodeSnapshot

NODE_ID_LABEL = "ray.io/node-id"  # Ray's built-in label, usable in bundle label selectors
HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node offers it: pins an actor there


def worker_slots(total: Mapping[str, float], worker_resources: Mapping[str, float]) -> int:
    """How many workers fit a node with ``total`` resources (the scarcest one decides)."""
    needed = {k: v for k, v in worker_resources.items() if v > 0}
    if not needed:
        return 0
    return min(math.floor(total.get(k, 0.0) / v + 1e-9) for k, v in needed.items())


def node_liveness() -> dict[str, bool]:
    return {node["NodeID"]: bool(node["Alive"]) for node in ray.nodes()}


def draining_nodes() -> dict[str, float | None]:
    """Nodes being drained (e.g. a preemption notice), with their deadline in wall-clock unix
    seconds (``None``: no deadline). Absolute, so whoever decides later uses the time left
    then. Ray has no public call for this yet; the GCS state accessor is the one its own
    autoscaler uses."""
    from ray._private.state import state

    return {
        node_id: deadline_ms / 1000 if deadline_ms else None
        for node_id, deadline_ms in state.get_draining_nodes().items()
    }


def schedulable_nodes(
    *, worker_resources: Mapping[str, float], avoid: set[str]
) -> list[NodeSnapshot]:
    """Live, non-draining nodes outside ``avoid``, with their worker slots and labels.

    Slots count a node's *total* resources: the job's own workers are torn down before a
    plan is carried out, and the placement group then reserves the slots for real (another
    tenant holding them shows up as a placement group that does not become ready).
    """
    draining = set(draining_nodes())
    snapshots = []
    for node in ray.nodes():
        node_id = node["NodeID"]
        if not node["Alive"] or node_id in draining or node_id in avoid:
            continue
        slots = worker_slots(node["Resources"], worker_resources)
        if slots:
            labels = {k: v for k, v in node.get("Labels", {}).items() if k != NODE_ID_LABEL}
            snapshots.append(NodeSnapshot(node_id=node_id, slots=slots, labels=labels))
    return snapshots
