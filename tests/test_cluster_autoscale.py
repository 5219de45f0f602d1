"""Elasticity with a real Ray autoscaler: a job whose dp range exceeds the starting cluster
asks the autoscaler for its full size, a node appears, and the job grows into it.

The autoscaler is Ray's own (its monitor process, reconciling every second), with Ray's fake
multi-node provider, which launches "cloud" nodes as raylets on this machine
(``ray start --head --autoscaling-config=…`` with ``RAY_FAKE_CLUSTER=1``; facts found with
Ray 2.60: ``AutoscalingCluster`` cannot be used, its example config is missing from the
wheel and it runs ``ray stop --force``, which kills every Ray process on the machine). The
cluster lives in its own temporary directory, and only the processes of that directory are
stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
from distributed import free_loopback_port
from ray_cluster import (
    HEALTH_CHECKS,
    cluster_options,
    job_options,
    start_job,
    stop_processes_under,
    wait_until,
)

from ringray.cluster.driver import release

pytestmark = pytest.mark.timeout(420)

TAG = "slot_autoscale"


def _fake_cluster_config(port: int) -> dict:
    """One worker node type of 2 slots, at least 1 and at most 2 of them."""
    return {
        "cluster_name": "ringray-test",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": f"127.0.0.1:{port}",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {}, "node_config": {}, "max_workers": 0},
            "worker_2_slots": {
                "resources": {"CPU": 2, TAG: 2},
                "node_config": {},
                "min_workers": 1,
                "max_workers": 2,
            },
        },
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@pytest.fixture()
def autoscaling_cluster():
    # Short: Unix socket paths under it must stay below the kernel's 108-byte limit.
    temp_dir = tempfile.mkdtemp(prefix="rr-as-", dir="/tmp")
    port = free_loopback_port()
    config = Path(temp_dir) / "autoscaler.json"
    config.write_text(json.dumps(_fake_cluster_config(port)))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    ray_cli = str(Path(sys.executable).parent / "ray")
    try:
        subprocess.run(
            [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=0",
             f"--temp-dir={temp_dir}", f"--autoscaling-config={config}",
             "--include-dashboard=false", "--disable-usage-stats",
             f"--system-config={json.dumps(HEALTH_CHECKS, separators=(',', ':'))}"],
            env=env, check=True, capture_output=True, timeout=120,
        )
        ray.init(address=f"127.0.0.1:{port}", namespace="ringray")
        yield
    finally:
        ray.shutdown()
        stop_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _slot_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get(TAG))


def test_job_asks_the_autoscaler_for_its_full_size_and_grows(
    autoscaling_cluster, tmp_path: Path
) -> None:
    """The cluster starts with one 2-slot node; the job wants dp=2 × cp=2 and may run at
    dp=1. It starts at dp=1 at once, requests 4 worker bundles from the autoscaler, which
    launches a second node, and the job grows to dp=2 at a checkpoint boundary, once."""
    deadline = time.monotonic() + 60
    while _slot_nodes() < 1:  # min_workers: the autoscaler's first node
        assert time.monotonic() < deadline, "the autoscaler never launched its first node"
        time.sleep(0.5)
    assert _slot_nodes() == 1

    options = job_options(str(tmp_path / "ray"), parallel={"dp": 2}, train={"steps": 100_000})
    controller = start_job(
        "autoscale", options,
        cluster_options(TAG, dp_min=1, request_resources=True, grow_after_seconds=1,
                        capacity_wait_seconds=60),
    )
    try:
        status = wait_until(controller, lambda s: s.step >= 1, timeout=120, what="a first step")
        assert status.dp == 1
        status = wait_until(controller, lambda s: s.dp == 2 and s.state == "running",
                            timeout=180, what="the job to grow to dp=2")
        assert _slot_nodes() == 2
        grown_at = status.step
        wait_until(controller, lambda s: s.step >= grown_at + 5, timeout=60,
                   what="steps at dp=2")
        controller.stop.remote()
        status = wait_until(controller, lambda s: s.done, timeout=120, what="the stop")
    finally:
        release(controller)

    assert status.state == "stopped", status.error
    assert status.resizes == 1 and status.restarts == ()
    messages = [event.message for event in status.events]
    assert any("asking the autoscaler for the full size" in m for m in messages)
    assert any(m.startswith("growing from dp=1 to dp=2") for m in messages)
    assert status.last_checkpoint_step == status.step  # the stop checkpointed
