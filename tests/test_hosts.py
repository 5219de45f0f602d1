"""The service across real hosts (:mod:`hosts`): each Ray node on a host of its own, with its
own address in 198.18.0.0/15, a host name nobody resolves, its own /tmp/ray and a link that
can be cut; `ringray train --address` run from a host as a user would.

The fault matrix of docs/operations.md ("Across hosts") comes from these tests; each prints
its row (``fault-matrix: ...``, shown with ``pytest -s``). Skipped where namespaces cannot be
made (not root); CI runs as root, so there they run.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from hosts import Host, Hosts, hosts_unavailable

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(hosts_unavailable() is not None,
                       reason=hosts_unavailable() or "real hosts available"),
]

ROOT = Path(__file__).resolve().parent.parent
RINGRAY = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "ringray"


def _job(tmp_path: Path, name: str, *, parallel: dict, steps: int, interval: int,
         cluster: dict | None = None, checkpoint_path: Path | None = None) -> Path:
    """A job file of the debug model at 256 tokens, fp32, SDPA, its run under ``tmp_path``
    (its checkpoints too, unless ``checkpoint_path`` puts them elsewhere)."""
    spec = {
        "name": name,
        "model": {"preset": "debug"},
        "data": {"source": "stdlib"},
        "parallel": {"dp": 1, "layout": "zigzag", "attention_backend": "sdpa", **parallel},
        "train": {"steps": steps, "global_batch": 2, "seq_len": 256, "precision": "fp32",
                  "peak_tflops_per_device": 1.0},
        "checkpoint": {"interval": interval,
                       **({"path": str(checkpoint_path)} if checkpoint_path else {})},
        "cluster": {"failure_domain": None, "replica_heartbeat_seconds": 1.0,
                    **(cluster or {})},
        "run_dir": str(tmp_path / "run"),
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _train(hosts: Hosts, on: Host, job: Path, log: Path) -> subprocess.Popen:
    """``ringray train JOB --address HEAD`` started on host ``on``."""
    return on.run([str(RINGRAY), "train", str(job), "--address", hosts.ray_address],
                  env=hosts.environment(), cwd=str(ROOT), stdout=log.open("w"),
                  stderr=subprocess.STDOUT)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.strip()]


def _wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, log: Path, *,
                   timeout: float = 240) -> float:
    """Until ``steps.jsonl`` holds ``step``; the time it was seen (polled every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while step not in _steps(run_dir):
        assert process.poll() is None, f"the job ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {step}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return time.monotonic()


def _events(run_dir: Path) -> list[str]:
    return [json.loads(line)["message"]
            for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def _finish(process: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert process.returncode == 0, text[-3000:]
    return text


def _training_host(candidates: list[Host], *, timeout: float = 20) -> Host:
    """The host among ``candidates`` whose worker is in a step (Ray titles an actor's
    process ``ray::<Class>.<method>`` while a call runs): a replica group's, not the
    standby group's, whose workers wait idle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for host in candidates:
            if host.runs("TrainWorker.run_steps"):
                return host
        time.sleep(0.05)
    raise AssertionError(f"no host of {[h.name for h in candidates]} runs a training step")


def _left_on_ray(hosts: Hosts) -> dict[str, list[str]]:
    """The actors alive and placement groups not removed on the hosts' Ray, asked from the
    head host (tests/ray_leftovers.py)."""
    return json.loads(hosts[0].check(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "tests" / "ray_leftovers.py"),
         hosts.ray_address], env=hosts.environment()))


def _step_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()
            if line.strip()]


def test_replica_groups_start_across_hosts_and_a_killed_hosts_group_heals_from_a_peer(
        tmp_path: Path) -> None:
    """Two replica groups (``parallel.dp_replicate: 2``), one on each of two hosts whose
    names nobody resolves, and the standby group on a third (the default keeps one where
    there is room); `ringray train --address` run on the first group's host, whose view of
    the run directory is node-local. The groups form their torchft quorum across hosts
    (they did not: torchft advertised host names). The second group's host is killed: the
    first group's steps go on, the standby replaces the lost group and heals from the live
    peer across hosts, no committed step is rolled back, the job never restarts, and at its
    end no actor or placement group is left on the cluster. Every file of the run directory
    is written by the controller on the head host (job.yaml was written by the driver: the
    driver's host holds none)."""
    run_dir = tmp_path / "run"
    with Hosts(4, local_dirs={1: str(run_dir)}) as hosts:  # host 1: the driver's
        hosts.start_ray(slots={1: 1, 2: 1, 3: 1}, log_dir=tmp_path / "ray")
        steps = 300  # about 0.1 s each: time for the replacement to start and heal
        job = _job(tmp_path, "hosts-replicas", parallel={"cp": 1, "dp_replicate": 2},
                   steps=steps, interval=100, checkpoint_path=tmp_path / "checkpoints")
        log = tmp_path / "train.log"
        process = _train(hosts, hosts[1], job, log)
        _wait_for_step(run_dir, 6, process, log)
        doomed = _training_host(hosts.hosts[2:])
        killed = time.monotonic()
        doomed.kill()
        done = len(_steps(run_dir))
        next_step = _wait_for_step(run_dir, done + 1, process, log)
        text = _finish(process, log)
        seen_by_driver = hosts[1].check(["ls", "-A", str(run_dir)]).split()
        left = _left_on_ray(hosts)

    events = _events(run_dir)
    # none leaked: only the cluster's autoscaler ledger, one detached actor that every job
    # shares by design (ringray/cluster/resource_requests.py), outlives the job
    assert set(left["actors"]) <= {"ResourceRequests"} and not left["placement_groups"], left
    assert _steps(run_dir) == list(range(1, steps + 1)), text  # none rolled back or repeated
    assert "restarts 0" in text and "(lost 1)" in text, text
    lost = [m for m in events if " lost (" in m and m.startswith("replica group ")]
    assert len(lost) == 1, events
    assert any("healed from a live peer" in m for m in events), events
    assert any(f"hold identical state at step {steps}" in m for m in events), events
    assert seen_by_driver == [], seen_by_driver
    assert {"job.yaml", "steps.jsonl", "events.jsonl"} <= {p.name for p in run_dir.iterdir()}
    assert yaml.safe_load((run_dir / "job.yaml").read_text())["run_dir"] == str(run_dir)
    print(f"fault-matrix: replica group's host killed | the other group trains on; the "
          f"standby on the spare host replaces it and heals | 0 | {next_step - killed:.1f}")


@pytest.mark.slow
def test_a_ring_across_hosts_driven_from_a_worker_host_has_one_writer_for_its_run_dir(
        tmp_path: Path) -> None:
    """A cp=2 ring whose ranks are on two hosts, `ringray train --address` run on one of
    them, whose own view of the run directory is a node-local tmpfs. The job trains to the
    end, and every file of the run directory, job.yaml included, is written by the
    controller on the head host: the driver's host sees none of them (job.yaml was written
    by the driver, so half the run directory lived on another host)."""
    run_dir = tmp_path / "run"
    with Hosts(3, local_dirs={1: str(run_dir)}) as hosts:
        hosts.start_ray(slots={1: 1, 2: 1}, log_dir=tmp_path / "ray")
        job = _job(tmp_path, "hosts-ring", parallel={"cp": 2}, steps=8, interval=4,
                   checkpoint_path=tmp_path / "checkpoints")
        log = tmp_path / "train.log"
        text = _finish(_train(hosts, hosts[1], job, log), log)
        seen_by_driver = hosts[1].check(["ls", "-A", str(run_dir)]).split()

    assert "finished at step 8/8" in text, text
    assert "2 cross-node hop(s) per ring step" in text, text
    assert seen_by_driver == [], seen_by_driver
    assert {"job.yaml", "steps.jsonl", "events.jsonl"} <= {p.name for p in run_dir.iterdir()}
    assert yaml.safe_load((run_dir / "job.yaml").read_text())["run_dir"] == str(run_dir)
    assert _steps(run_dir) == list(range(1, 9))


@pytest.mark.slow
def test_a_partitioned_replica_host_is_replaced_and_fenced_when_it_comes_back(
        tmp_path: Path) -> None:
    """As the kill above, but group 1's host is cut off (alive, unreachable): the head
    declares its node dead, the other group trains on, the replacement heals from it on the
    spare host. Then the link comes back while the replacement runs: the stale host's
    workers must not rejoin a quorum (no step of more than two groups), write a step or a
    checkpoint, and they end (Ray's raylet of a node declared dead exits with its workers)."""
    with Hosts(4) as hosts:
        hosts.start_ray(slots={1: 1, 2: 1, 3: 1}, log_dir=tmp_path / "ray")
        steps = 600
        job = _job(tmp_path, "hosts-partition", parallel={"cp": 1, "dp_replicate": 2},
                   steps=steps, interval=100)
        log = tmp_path / "train.log"
        process = _train(hosts, hosts.head, job, log)
        run_dir = tmp_path / "run"
        _wait_for_step(run_dir, 6, process, log)
        cut_off = _training_host(hosts.hosts[1:])
        cut = time.monotonic()
        cut_off.partition()
        done = len(_steps(run_dir))
        next_step = _wait_for_step(run_dir, done + 1, process, log)
        deadline = time.monotonic() + 240
        while not any("healed from a live peer" in m for m in _events(run_dir)):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        cut_off.heal()
        healed_link = time.monotonic()
        stale_left = None
        while time.monotonic() - healed_link < 60 and process.poll() is None:
            python = [pid for pid in cut_off.pids()
                      if "python" in Path(f"/proc/{pid}/exe").resolve().name]
            if not python:
                stale_left = time.monotonic() - healed_link
                break
            time.sleep(1)
        text = _finish(process, log)

    events = _events(run_dir)
    lines = _step_lines(run_dir)
    assert [s["step"] for s in lines] == list(range(1, steps + 1)), text
    assert max(s["quorum_size"] for s in lines) == 2, text  # the stale group never rejoined
    assert "restarts 0" in text, text
    assert len([m for m in events if m.startswith("replica group ") and " lost (" in m]) == 1
    assert any(f"hold identical state at step {steps}" in m for m in events), events
    assert stale_left is not None, "the partitioned host's Python processes lived on"
    print(f"fault-matrix: replica group's host partitioned, back after the heal | the other "
          f"group trains on; the replacement heals on the spare host; the stale host's "
          f"processes end {stale_left:.0f} s after its link returns | 0 | "
          f"{next_step - cut:.1f}")


@pytest.mark.slow
def test_a_node_local_checkpoint_path_is_refused_in_one_line(tmp_path: Path) -> None:
    """``checkpoint.path`` names a directory that each ring host has its own of (a local
    disk): the first checkpoint cannot be committed (rank 0 does not see the other host's
    files), and the job fails in one line naming the location, with no committed
    checkpoint and no retry of a fault no retry can fix."""
    local = tmp_path / "local-checkpoints"
    with Hosts(3, local_dirs={1: str(local), 2: str(local)}) as hosts:
        hosts.start_ray(slots={1: 1, 2: 1}, log_dir=tmp_path / "ray")
        job = _job(tmp_path, "hosts-local", parallel={"cp": 2}, steps=8, interval=4,
                   checkpoint_path=local)
        log = tmp_path / "train.log"
        process = _train(hosts, hosts.head, job, log)
        process.wait(timeout=300)
        text = log.read_text()

    assert process.returncode != 0, text
    events = _events(tmp_path / "run")
    failed = [m for m in events if "share" in m]
    assert failed, events
    print(f"fault-matrix: node-local checkpoint.path | refused at the first commit: "
          f"{failed[0].splitlines()[0][:200]} | 0 | -")


@pytest.mark.slow
def test_the_head_cut_off_from_one_ring_host_moves_the_ring_to_the_spare(
        tmp_path: Path) -> None:
    """The head host loses its route to one ring host, which still reaches the other ring
    host: the head declares that node dead, the job restarts from its last checkpoint on the
    ring host it still reaches and the spare, and finishes; steps after the checkpoint are
    trained again, none before it."""
    with Hosts(4) as hosts:
        hosts.start_ray(slots={1: 1, 2: 1, 3: 1}, log_dir=tmp_path / "ray")
        steps = 200
        job = _job(tmp_path, "hosts-head-cut", parallel={"cp": 2}, steps=steps, interval=20)
        log = tmp_path / "train.log"
        process = _train(hosts, hosts.head, job, log)
        run_dir = tmp_path / "run"
        _wait_for_step(run_dir, 30, process, log)
        ring = [h for h in hosts.hosts[1:] if h.runs("ray::TrainWorker")]
        cut = time.monotonic()
        ring[0].cut_from(hosts.head)
        done = len(_steps(run_dir))
        deadline = time.monotonic() + 240
        while not any(", restored " in m for m in _events(run_dir)):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        resumed = max(_steps(run_dir), default=0)
        next_step = _wait_for_step(run_dir, resumed + 1, process, log)
        text = _finish(process, log)

    assert _steps(run_dir) == list(range(1, steps + 1)), text  # cut back to the restore
    events = _events(run_dir)
    restored = [m for m in events if ", restored " in m]
    at = int(restored[-1].split(" at step ")[1].split(",")[0])
    print(f"fault-matrix: head cut off from one ring host | the ring restarts from its "
          f"step-{at} checkpoint without that host | {done - at} (uncommitted) | "
          f"{next_step - cut:.1f}")


@pytest.mark.slow
def test_collectives_leave_by_the_interface_that_reaches_the_peers(tmp_path: Path) -> None:
    """A ring host has a second interface on a network that reaches none of the others,
    and its host name resolves to that interface's address (gloo's default choice). The ring
    trains, and its traffic leaves by the first interface, the one holding the node's
    address: the second carries none of it."""
    with Hosts(3, second_interface=(1,)) as hosts:
        hosts[1].resolve_name_to(hosts[1].second_address)
        hosts.start_ray(slots={1: 1, 2: 1}, log_dir=tmp_path / "ray")
        job = _job(tmp_path, "hosts-two-nics", parallel={"cp": 2}, steps=8, interval=4)
        before = hosts[1].sent_bytes("eth0"), hosts[1].sent_bytes("eth1")
        log = tmp_path / "train.log"
        text = _finish(_train(hosts, hosts.head, job, log), log)
        after = hosts[1].sent_bytes("eth0"), hosts[1].sent_bytes("eth1")

    assert "finished at step 8/8" in text, text
    first, second = after[0] - before[0], after[1] - before[1]
    assert first > 1_000_000, (first, second)  # 8 steps of a ring: megabytes
    assert second < 10_000, (first, second)  # at most neighbour discovery, no ring traffic
    print(f"fault-matrix: a ring host with a second, unroutable interface its name resolves "
          f"to | trains; eth0 sent {first / 1e6:.1f} MB, eth1 {second} B | 0 | -")
