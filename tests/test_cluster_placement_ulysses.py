"""Ulysses × ring on a real local Ray cluster: every Ulysses group lands on one node.

The issue's case: 2 nodes × 2 worker slots, a job of cp 4 as ring 2 × ulysses 2. The
controller plans with ``parallel.ulysses`` (``plan_placement(..., ulysses=2)``), real worker
actors start in a placement group pinned to the planned nodes, each actor is asked where it
runs (``WorkerHealth.node_id``, from Ray's runtime context inside the actor), and the job
trains a step over gloo with the all-to-alls inside each node.

On 2 × 2 slots a plain ring of 4 lands the same way, so a second case makes the constraint
visible: on 2 nodes × 3 slots a plain ring of 4 takes 3 slots of one node and 1 of the other
(ranks 0-2 and 3, splitting the Ulysses group {2, 3}), and with ulysses 2 it must take 2 of
each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_cluster import LocalCluster, cluster_options, finish, job_options, start_job

pytestmark = pytest.mark.timeout(300)


def _run_ring2_ulysses2(cluster: LocalCluster, tag: str, slots: int, run_dir: Path):
    """A one-step job of cp 4 = ring 2 × ulysses 2 on two fresh nodes of ``slots`` slots;
    its final status and the two nodes' ids."""
    try:
        a = cluster.add_node(tag, slots=slots, labels={"zone": "a"})
        b = cluster.add_node(tag, slots=slots, labels={"zone": "b"})
        job = start_job(
            f"ulysses-place-{slots}",
            job_options(str(run_dir), parallel={"dp": 1, "cp": 4, "ulysses": 2},
                        train={"steps": 1, "seq_len": 64}),
            cluster_options(tag),
        )
        return finish(job), {a.node_id, b.node_id}
    finally:
        cluster.remove_all()


@pytest.mark.parametrize("slots", [
    # slow (make test-all): make test keeps 3 slots, where a plain ring would split 3 + 1
    pytest.param(2, marks=pytest.mark.slow),
    3,
])
def test_each_ulysses_group_runs_on_one_node(local_cluster, tmp_path: Path, slots: int) -> None:
    """Ranks {0, 1} and {2, 3} (the Ulysses groups) each share a node, the two groups use
    both nodes, the ring (ranks 0, 2 and 1, 3) crosses between them, every actor runs on
    the node the plan gave its rank, and the step really exchanged heads."""
    status, node_ids = _run_ring2_ulysses2(local_cluster, f"slot_ulysses_{slots}", slots,
                                           tmp_path / "run")
    assert status.state == "finished", status.error
    planned = [rank.node_id for rank in status.plan.ranks]
    assert planned[0] == planned[1] and planned[2] == planned[3]
    assert {planned[0], planned[2]} == node_ids
    (ring,) = status.plan.rings
    assert ring.cross_node_hops == 2
    actual = [worker.node_id for worker in sorted(status.workers, key=lambda w: w.rank)]
    assert actual == planned
    assert all(seconds > 0 for seconds in status.last_stats.a2a_seconds)
