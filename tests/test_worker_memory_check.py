"""A job whose worker cannot fit its node's memory is refused on a cluster too (issue 28):
each worker checks its own node before its session is built (``TrainWorker.check_memory``,
:mod:`ringray.train.memory_check`), the job fails in one line naming the figures, without a
retry, and ``--force`` (``train.memory_check: false``) starts it anyway.

The cluster test runs ``ringray train --address`` against a real local Ray node whose memory
is set by ``RINGRAY_NODE_MEMORY_BYTES`` in its environment (so nothing is allocated for real);
the check itself, the count of the job's workers on the node and the failure's path through
the controller are the real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from progress import finish
from train_cases import changed, tiny_options
from typer.testing import CliRunner

from ringray.accelerators import GIB
from ringray.train.memory_check import (
    MEMORY_RESERVE_RATIO,
    NODE_MEMORY_VARIABLE,
    WorkerShare,
    available_memory_bytes,
    check_worker_memory,
    host_memory,
    planned_footprint,
    size,
)
from ringray.train.options import TrainOptions

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
RINGRAY = str(Path(sys.executable).parent / "ringray")
NODE_BYTES = 8 * GIB  # the test node's memory, as RINGRAY_NODE_MEMORY_BYTES gives it


# ---- the arithmetic: one check for `ringray plan`, the CLI and the workers ------------------

@pytest.mark.parametrize("section", [
    {},
    {"parallel": {"fsdp": True, "dp": 2}},
    {"parallel": {"ulysses": 2}, "train": {"activation_checkpointing": "selective"}},
    {"train": {"activation_checkpointing": "full", "precision": "bf16"}},
])
def test_the_workers_plan_what_ringray_plan_plans(section: dict) -> None:
    """The workers' footprint is ``ringray plan``'s (PlanInputs at the job's mesh), and the
    names ringray.capacity exports are the shared module's."""
    import ringray.capacity as capacity
    from ringray.capacity import PlanInputs, plan_footprint

    options = changed(tiny_options("unused", parallel={"cp": 4}, train={"global_batch": 4}),
                      **section)
    dp, cp = options.parallel.dp, options.parallel.cp
    for on_gpu in (False, True):
        bf16 = capacity.runs_bf16(options.train.precision, on_gpu=on_gpu)
        inputs = PlanInputs.of_mesh(options, dp=dp, cp=cp, name="job", bf16=bf16,
                                    foreach=on_gpu)
        assert planned_footprint(options, dp=dp, cp=cp, on_gpu=on_gpu) == plan_footprint(inputs)
    assert capacity.check_worker_memory is check_worker_memory
    assert capacity.WorkerShare is WorkerShare
    assert capacity.MEMORY_RESERVE_RATIO is MEMORY_RESERVE_RATIO


def test_a_nodes_memory_can_be_given_in_its_environment(monkeypatch) -> None:
    monkeypatch.delenv(NODE_MEMORY_VARIABLE, raising=False)
    where, available = host_memory("this host")
    assert where == "this host's available memory" and available > 0
    assert abs(available - available_memory_bytes()) < GIB  # the same probe, moments apart
    monkeypatch.setenv(NODE_MEMORY_VARIABLE, str(3 * GIB))
    assert host_memory("node 1234abcd") == (
        f"node 1234abcd's memory as {NODE_MEMORY_VARIABLE} gives it", 3 * GIB)
    for bad in ("8GiB", "0", "-1"):
        monkeypatch.setenv(NODE_MEMORY_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{NODE_MEMORY_VARIABLE}: '{bad}' on node x is "
                                             f"not a positive number of bytes"):
            host_memory("node x")


def test_submit_force_turns_the_check_off_in_what_it_sends() -> None:
    """A submission runs `ringray train --address auto` on the cluster: --force reaches its
    workers as an override (which `ringray resume ID` submits again)."""
    from ringray.cli import app

    def entrypoint(*args: str) -> str:
        result = CliRunner().invoke(app, ["submit", "jobs/quickstart.yaml", "--dry-run",
                                          "--no-pip", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout[:result.stdout.rindex("}") + 1])["entrypoint"]

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert "train.memory_check=false" in entrypoint("--force")
        assert "memory_check" not in entrypoint()
    finally:
        os.chdir(cwd)


# ---- on a real cluster -----------------------------------------------------------------------

def _train(address: str, run_dir: Path, name: str, *args: str) -> subprocess.Popen:
    """``ringray train jobs/quickstart.yaml --address ADDRESS`` on the test's node (its
    workers ask for the node's own resource), a ring of 2, no evaluation or metrics."""
    command = [RINGRAY, "train", "jobs/quickstart.yaml", "--address", address,
               "--set", f"name={name}", "--set", f"run_dir={run_dir}",
               "--set", "parallel.cp=2", "--set", "eval.passkey_lengths=[]",
               "--set", "metrics.port=null", "--set", "cluster.poll_seconds=0.2",
               "--set", "cluster.worker_resources={CPU: 1, slot_memory: 1}", *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(process: subprocess.Popen, run_dir: Path, *,
            started: float) -> tuple[int, str, str, float]:
    out, err = finish(process, run_dir)  # waits while the run makes progress
    return process.returncode, out, err, time.monotonic() - started


def _events(run_dir: Path) -> list[str]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line)["message"] for line in lines if line.strip()]


def _quickstart(**train: int) -> TrainOptions:
    """jobs/quickstart.yaml's options on a ring of 2 with ``train`` changed."""
    from ringray.spec import load_job_spec

    options = load_job_spec(str(ROOT / "jobs/quickstart.yaml")).train_options()
    return changed(options, parallel={"cp": 2}, train=train)


@pytest.mark.slow
def test_a_job_that_cannot_fit_its_node_is_refused_on_the_cluster(local_cluster,
                                                                  tmp_path: Path) -> None:
    """A node whose memory (RINGRAY_NODE_MEMORY_BYTES) is the planned peak of one worker of
    a seq-256 job, shared by 2 workers: a seq-16M job is refused by its workers before their
    sessions are built, in one line with the figures, and fails without a retry, its run
    directory released and without job.yaml, steps or checkpoints. Beside it on the same node
    (so each job counts only its own 2 workers there), the seq-256 job, which would be
    refused too, runs with --force."""
    from ringray.train.run_lock import RunLock

    small = planned_footprint(_quickstart(seq_len=256), dp=1, cp=2, on_gpu=False).peak_bytes
    node_bytes = small  # half of it each, less the reserve: the small job does not fit
    node = local_cluster.cluster.add_node(num_cpus=4, resources={"slot_memory": 4},
                                          env_vars={NODE_MEMORY_VARIABLE: str(node_bytes)})
    local_cluster.cluster.wait_for_nodes()
    local_cluster.nodes.append(node)
    address = local_cluster.cluster.address
    refused_dir, forced_dir = tmp_path / "refused", tmp_path / "forced"
    try:
        started = time.monotonic()
        refused = _train(address, refused_dir, "memory-refused",
                         "--set", "train.seq_len=16777216")
        forced = _train(address, forced_dir, "memory-forced", "--force", "--steps", "1",
                        "--set", "train.seq_len=256")
        code, _, stderr, took = _finish(refused, refused_dir, started=started)
        print(f"refused in {took:.1f} s")
        forced_code, forced_out, forced_err, forced_took = _finish(
            forced, forced_dir, started=started)
        print(f"forced run in {forced_took:.1f} s")
    finally:
        local_cluster.remove_all()

    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    print(last)
    peak = planned_footprint(_quickstart(seq_len=16777216), dp=1, cp=2,
                             on_gpu=False).peak_bytes
    usable = int(node_bytes / 2 * (1 - MEMORY_RESERVE_RATIO))
    assert last.startswith("error: job 'memory-refused' failed at step 0: rank "), last
    assert f"memory: one worker needs about {size(peak)} at its peak" in last
    assert f"more than the {size(usable)} it has (node {node.node_id[:8]}'s memory as " \
           f"{NODE_MEMORY_VARIABLE} gives it, {size(node_bytes)} shared by 2 workers, less " \
           f"10% reserve)" in last
    assert last.endswith("(--force starts it anyway)")
    # Failed at the start, not retried: no recovery, no restart, never started.
    events = _events(refused_dir)
    error = last.split(": ", 2)[-1]  # "rank N: memory: ...", as the controller recorded it
    assert events[-1] == "state: failed" and events.count(error) == 1, events
    assert not [e for e in events if "restart" in e or e.startswith("state: recovering")]
    assert "state: running" not in events
    for written in ("job.yaml", "steps.jsonl", "checkpoints"):
        assert not (refused_dir / written).exists(), written
    RunLock(str(refused_dir), job="next").check()  # released: the next run may take it

    # Without --force the small job would be refused as well; with it, it trains.
    share = WorkerShare(node="node", node_bytes=node_bytes, workers=2)
    assert check_worker_memory(_quickstart(seq_len=256), dp=1, cp=2, on_gpu=False,
                               share=share) is not None
    assert forced_code == 0, forced_err[-3000:]
    assert "job 'memory-forced' finished at step 1/1" in forced_out, forced_out
    assert not [e for e in _events(forced_dir) if "memory:" in e]
