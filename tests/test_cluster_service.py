"""The Ray service on a real local multi-node cluster: placement, and recovery from a node's
death, a killed worker and a hung worker.

Each test adds its own nodes (see ``ray_cluster``), runs a real job of the tiny model with a
real controller and real worker actors over gloo, and removes its nodes at the end.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import run_gloo_ranks
from ray_cluster import (
    LocalCluster,
    cluster_options,
    finish,
    job_options,
    start_job,
    wait_until,
)
from train_cases import rank_run_training, weights_from_checkpoint

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def local_cluster():
    cluster = LocalCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture()
def nodes(local_cluster):
    """The test's nodes are removed when it ends, whatever happened."""
    yield local_cluster
    local_cluster.remove_all()


def _node_id(node) -> str:
    return node.node_id


def _uninterrupted_weights(options, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The same training run straight through on plain gloo processes (no Ray)."""
    straight = replace(options, run_dir=str(tmp_path / "straight"))
    world = (options.dp or 1) * options.cp
    return run_gloo_ranks(world, rank_run_training, [(straight, None)])[0][0]["weights"]


def _final_weights(options) -> dict[str, torch.Tensor]:
    """The weights of the run's newest checkpoint, loaded in this process (any dp/cp loads)."""
    return weights_from_checkpoint(replace(options, dp=1, cp=1))


def _assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


def _assert_resumed_from_last_checkpoint(restart, interval: int) -> None:
    """The restart restored the newest checkpoint before the failure: at most one interval
    of steps is done again."""
    assert restart.resumed_from_step % interval == 0
    assert 0 <= restart.lost_steps <= interval
    assert restart.lost_steps == restart.failed_at_step - restart.resumed_from_step


def test_rings_are_placed_as_planned(nodes, tmp_path: Path) -> None:
    """2 nodes × 2 slots: with cp=2, dp=2 each ring sits on one node (no crossing); with
    cp=4 the one ring spans both nodes with exactly 2 crossings. Every worker runs on the
    node the plan gave its rank."""
    tag = "slot_place"
    a = nodes.add_node(tag, slots=2, labels={"zone": "a"})
    b = nodes.add_node(tag, slots=2, labels={"zone": "b"})

    two_rings = start_job(
        job_options(str(tmp_path / "rings"), steps=1, dp=2, global_batch=2),
        cluster_options(tag, "place-rings", dp_max=2, dp_min=2),
    )
    status = finish(two_rings)
    assert status.state == "finished", status.error
    plan = status.plan
    assert (plan.dp, plan.cp) == (2, 2)
    assert [ring.cross_node_hops for ring in plan.rings] == [0, 0]
    assert {ring.nodes for ring in plan.rings} == {(_node_id(a),), (_node_id(b),)}
    assert [w.node_id for w in status.workers] == [r.node_id for r in plan.ranks]

    one_ring = start_job(
        job_options(str(tmp_path / "ring4"), steps=1, cp=4, seq_len=64),
        cluster_options(tag, "place-ring4", cp=4),
    )
    status = finish(one_ring)
    assert status.state == "finished", status.error
    (ring,) = status.plan.rings
    assert ring.cross_node_hops == 2
    assert set(ring.nodes) == {_node_id(a), _node_id(b)}
    actual = [w.node_id for w in status.workers]
    assert actual == [r.node_id for r in status.plan.ranks]
    assert actual[0] == actual[1] and actual[2] == actual[3] and actual[1] != actual[2]


def test_node_death_mid_run_recovers_to_the_uninterrupted_weights(nodes, tmp_path: Path) -> None:
    """A CP=2 ring's node is killed after step 5 (checkpoints every 4 steps) and a replacement
    node joins. The job finishes with weights bit-identical to an uninterrupted run's, redoes
    at most one checkpoint interval, and reports the restart with its recovery time."""
    tag = "slot_death"
    first = nodes.add_node(tag, slots=2)
    options = job_options(str(tmp_path / "ray"), steps=40)
    controller = start_job(options, cluster_options(tag, "node-death"))
    status = wait_until(controller, lambda s: s.step >= 5, timeout=120, what="step 5")
    assert {w.node_id for w in status.workers} == {_node_id(first)}

    nodes.remove_node(first)
    replacement = nodes.add_node(tag, slots=2)
    status = finish(controller)

    assert status.state == "finished", status.error
    (restart,) = status.restarts
    assert restart.reason == "node_died"
    _assert_resumed_from_last_checkpoint(restart, options.checkpoint_interval)
    assert restart.recovery_seconds is not None and restart.recovery_seconds > 0
    assert {w.node_id for w in status.workers} == {_node_id(replacement)}
    steps = [line for line in (tmp_path / "ray" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == options.steps  # the log was cut back to the restored step
    _assert_same_weights(_final_weights(options), _uninterrupted_weights(options, tmp_path))


def test_killed_worker_and_hung_worker_are_recovered(nodes, tmp_path: Path) -> None:
    """A worker process SIGKILLed, then (in the same job) a worker stopped inside a step with
    SIGSTOP: the first is seen as a dead actor, the second as a hang once the step timeout
    passes. Both are recovered from the last checkpoint, and the job ends with the
    uninterrupted run's weights."""
    tag = "slot_kill"
    nodes.add_node(tag, slots=2)
    options = job_options(str(tmp_path / "ray"), steps=48)
    controller = start_job(
        options, cluster_options(tag, "kill-and-hang", step_timeout_seconds=6)
    )
    status = wait_until(controller, lambda s: s.step >= 3, timeout=120, what="step 3")
    os.kill(status.workers[1].pid, signal.SIGKILL)

    status = wait_until(
        controller,
        lambda s: len(s.restarts) == 1 and s.restarts[0].recovery_seconds is not None
        and s.step >= s.restarts[0].resumed_from_step + 5,
        timeout=120, what="recovery, then 5 more steps",
    )
    hung_pid = status.workers[0].pid
    os.kill(hung_pid, signal.SIGSTOP)
    try:
        status = finish(controller)
    finally:
        try:  # the controller killed it; make sure, since a stopped process ignores the rest
            os.kill(hung_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    assert status.state == "finished", status.error
    killed, hung = status.restarts
    assert killed.reason == "actor_died" and hung.reason == "hang"
    _assert_resumed_from_last_checkpoint(killed, options.checkpoint_interval)
    _assert_resumed_from_last_checkpoint(hung, options.checkpoint_interval)
    assert "rank(s) 0 do not answer" in hung.detail
    assert status.failures_used == 2
    _assert_same_weights(_final_weights(options), _uninterrupted_weights(options, tmp_path))
