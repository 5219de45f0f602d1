"""GPU workers set up as Ray Train sets them up: a node's workers of a job see all of its GPUs
there and each uses its own by local rank; collectives leave by the interface that holds the
node's address unless the user chose one. The plan is pure; a real Ray cluster whose nodes
declare (fake) GPUs shows what each worker actor would run with."""

from __future__ import annotations

import ray
from ray_cluster import job_options

from ringray.cluster.devices import (
    DeviceSetup,
    WorkerPlace,
    interface_of,
    plan_devices,
    socket_variables,
)
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.record import JobRecord
from ringray.cluster.worker_group import RayWorkerGroup
from ringray.metrics import MetricsOptions


def test_a_nodes_workers_share_its_gpus_and_each_uses_its_own() -> None:
    places = [WorkerPlace(node_id="a", gpu_ids=("3",), interface="eth0"),
              WorkerPlace(node_id="a", gpu_ids=("1",), interface="eth0"),
              WorkerPlace(node_id="b", gpu_ids=("0",), interface="ib0"),
              WorkerPlace(node_id="a", gpu_ids=("10",), interface="eth0")]
    setups = plan_devices(places)
    assert [s.visible_devices for s in setups] == ["1,3,10", "1,3,10", "0", "1,3,10"]
    assert [s.local_rank for s in setups] == [1, 0, 0, 2]  # numeric order: 10 after 3
    assert [s.interface for s in setups] == ["eth0", "eth0", "ib0", "eth0"]


def test_cpu_workers_get_no_visible_devices() -> None:
    setups = plan_devices([WorkerPlace(node_id="a", gpu_ids=(), interface=None)] * 2)
    assert setups == [DeviceSetup(visible_devices=None, local_rank=0, interface=None)] * 2


def test_the_interface_is_the_one_holding_the_nodes_address() -> None:
    interfaces = {"lo": ["127.0.0.1"], "eth0": ["10.1.2.3"], "ib0": ["10.9.0.1"]}
    assert interface_of("10.9.0.1", interfaces) == "ib0"
    assert interface_of("172.16.0.1", interfaces) is None


def test_a_users_interface_choice_is_kept() -> None:
    setup = DeviceSetup(visible_devices=None, local_rank=0, interface="eth0")
    assert socket_variables(setup, {}) == {"NCCL_SOCKET_IFNAME": "eth0",
                                           "GLOO_SOCKET_IFNAME": "eth0"}
    assert socket_variables(setup, {"GLOO_SOCKET_IFNAME": "lo"}) == {
        "NCCL_SOCKET_IFNAME": "eth0"}


def test_worker_actors_on_gpu_nodes_see_the_nodes_gpus(local_cluster, tmp_path) -> None:
    """Two nodes declaring 2 GPUs each (no real device is touched): a job of 4 GPU workers
    places 2 per node; each worker sees both of its node's GPUs and uses its own, and its
    collective interfaces are the node's."""
    tag = "slot_gpu_devices"
    nodes = [local_cluster.cluster.add_node(num_cpus=2, num_gpus=2, resources={tag: 2})
             for _ in range(2)]
    local_cluster.cluster.wait_for_nodes()
    local_cluster.nodes.extend(nodes)
    job = JobOptions(
        name="gpu-devices", train=job_options(str(tmp_path), parallel={"cp": 4}),
        cluster=ClusterOptions(accelerator="gpu", worker_resources={"GPU": 1, tag: 1},
                               startup_timeout_seconds=280, poll_seconds=0.2,  # under pytest's 300
                               request_resources=False),
        metrics=MetricsOptions(port=None))
    group = RayWorkerGroup(job, JobRecord(job, tmp_path, metrics=None),
                           should_stop=lambda: False)
    try:
        plan = group.plan((1,), avoid=frozenset())
        group._create_workers(plan)
        group._set_up_devices()
        seen = ray.get([w.environment.remote() for w in group.workers])
        places = ray.get([w.devices.remote() for w in group.workers])
    finally:
        group.teardown()
        local_cluster.remove_all()
    by_node: dict[str, list[dict]] = {}
    for place, env in zip(places, seen, strict=True):
        by_node.setdefault(place.node_id, []).append(env)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # both of the node's GPUs
        assert env["cuda_device"] == int(place.gpu_ids[0])  # its own: the one Ray gave it
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == place.interface
        assert place.interface is not None
    assert sorted(len(envs) for envs in by_node.values()) == [2, 2]
    for envs in by_node.values():
        assert sorted(env["cuda_device"] for env in envs) == [0, 1]
