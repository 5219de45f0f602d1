"""Jobs sharing a cluster do not cancel each other's autoscaler requests: the standing request
is the sum of the live jobs' full sizes, and a job that ends withdraws only its own (Ray's
``request_resources`` replaces the whole request on every call)."""

from __future__ import annotations

import json
from pathlib import Path

import ray
from ray_cluster import cluster_options, job_options

from ringray.cluster.job_options import JobOptions
from ringray.cluster.record import JobRecord
from ringray.cluster.resource_requests import resource_requests
from ringray.cluster.worker_group import RayWorkerGroup
from ringray.metrics import MetricsOptions


def _standing_request() -> list[dict]:
    """What the autoscaler is asked for now, as Ray stored it."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    assert not is_autoscaler_v2()  # a local test cluster: the request is kept in the KV store
    stored = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(stored) if stored else []


def _group(name: str, tmp_path: Path, *, cp: int, dp: int) -> RayWorkerGroup:
    job = JobOptions(name=name, train=job_options(str(tmp_path / name),
                                                  parallel={"cp": cp, "dp": dp},
                                                  train={"global_batch": dp * 2}),
                     cluster=cluster_options(f"slot_{name}", request_resources=True),
                     metrics=MetricsOptions(port=None))
    return RayWorkerGroup(job, JobRecord(job, tmp_path / name, metrics=None),
                          should_stop=lambda: False)


def test_one_job_ending_leaves_the_others_request_standing(local_cluster, tmp_path) -> None:
    a = _group("reqa", tmp_path, cp=2, dp=2)
    b = _group("reqb", tmp_path, cp=2, dp=1)
    try:
        a.ask_for_full_size()
        b.ask_for_full_size()
        want_a = [{"CPU": 1.0, "slot_reqa": 1.0}] * 4
        want_b = [{"CPU": 1.0, "slot_reqb": 1.0}] * 2
        assert sorted(map(json.dumps, _standing_request())) == sorted(
            map(json.dumps, want_a + want_b))
        a.ask_for_full_size()  # asking again replaces the job's own request, not adds to it
        assert len(_standing_request()) == 6
        a.withdraw_request()
        assert _standing_request() == want_b
        b.withdraw_request()
        assert _standing_request() == []
    finally:
        ray.kill(resource_requests())


def test_a_job_of_replica_groups_asks_for_every_group_and_its_standby(local_cluster,
                                                                     tmp_path) -> None:
    """It asked for one group's workers (dp × cp) before: a cluster that scaled to that
    request could never start the other groups."""
    from ringray.cluster.replica_groups import ReplicatedWorkerGroup

    job = JobOptions(name="reqr", train=job_options(
        str(tmp_path / "reqr"), parallel={"cp": 2, "dp": 1, "dp_replicate": 2},
        train={"global_batch": 2}),
        cluster=cluster_options("slot_reqr", request_resources=True),
        metrics=MetricsOptions(port=None))
    group = ReplicatedWorkerGroup(job, JobRecord(job, tmp_path / "reqr", metrics=None),
                                  should_stop=lambda: False)
    try:
        group.ask_for_full_size()
        # two groups of 1 × 2 workers, and the standby group's 2 (cluster.replica_standby)
        assert _standing_request() == [{"CPU": 1.0, "slot_reqr": 1.0}] * 6
        group.withdraw_request()
        assert _standing_request() == []
    finally:
        group.close()
        ray.kill(resource_requests())
