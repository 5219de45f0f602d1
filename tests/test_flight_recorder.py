"""A hung step leaves evidence (issue 41): every live worker's flight recorder, written by the
controller into the run directory before it kills the workers, and one event naming it.

- **What a worker starts with.** Every backend gets torch's recorder size; NCCL workers also
  get torch's own dump on a collective timeout or error, pointed into the run directory
  (torch 2.13's names; it warns on the older aliases), with the dump grace to write it in. Gloo
  records (checked for real below) but has no dump on timeout of its own, so it gets none
  of those. The worker actor applies them before any process group exists and makes the
  directory torch will write into.
- **The timeouts' order.** The kill (step timeout + dump grace) comes before the collective
  timeout (2 step timeouts), so the workers are alive to be asked and NCCL's watchdog never
  aborts them first; a ``cluster.hang_dump_seconds`` that would reorder them is refused in
  one line naming the field, through the job spec too.
- **The record.** Real dumps from real gloo processes (rank 1 inside an all-reduce its peer
  has not joined): :meth:`JobRecord.flight_recorder` writes ``rank_<r>`` files and one
  ``events.jsonl`` line saying where, what each rank waits for (its oldest unfinished
  collective and the ringray frame that called it), NCCL's own dumps found in the directory
  and the ranks that did not answer.
- **End to end** on a real local Ray cluster: a gloo job of 2 workers, rank 0 stopped with
  SIGSTOP mid-run. At the step timeout the controller asks both workers for their recorders
  (rank 1 answers from its second thread while its step waits on rank 0; rank 0 cannot),
  writes rank 1's real dump and records the event, and only then recovers.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_gloo_ranks
from ray_cluster import cluster_options, finish, job_options, start_job, wait_until
from train_cases import tiny_options

from ringray.cluster.flight_recorder import (
    NCCL_DUMP_PREFIX,
    RECORDER_ENTRIES,
    WorkerDump,
    pending_collective,
    rank_summary,
    recorder_directory,
    recorder_environment,
    thread_stacks,
)
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.record import JobRecord
from ringray.cluster.worker import TrainWorker
from ringray.metrics import MetricsOptions
from ringray.spec import JobSpecError, parse_job_spec

NCCL_ONLY = ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING",
             "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC")


# ------------------------------------------------------------------ what a worker starts with
def test_nccl_workers_dump_into_the_run_directory_gloo_workers_only_record(tmp_path) -> None:
    directory = recorder_directory(tmp_path / "run", "ringray-job-20261129T101500")
    assert directory == tmp_path / "run" / "flight-recorder" / "ringray-job-20261129T101500"
    nccl = recorder_environment("nccl", directory=directory, dump_seconds=7.5)
    prefix = str(directory / NCCL_DUMP_PREFIX)
    assert nccl == {
        "TORCH_FR_BUFFER_SIZE": str(RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "7500",
    }
    gloo = recorder_environment("gloo", directory=directory, dump_seconds=7.5)
    assert gloo == {"TORCH_FR_BUFFER_SIZE": str(RECORDER_ENTRIES)}
    assert not set(NCCL_ONLY) & set(gloo)


def test_the_worker_sets_them_before_any_group(tmp_path, monkeypatch) -> None:
    """The actor's constructor: the variables are in its environment (reported by
    ``environment()``) and the directory torch writes NCCL's dumps into exists."""
    directory = tmp_path / "run" / "flight-recorder" / "ringray-job-1"
    variables = recorder_environment("nccl", directory=directory, dump_seconds=2)
    for name in variables:  # so that monkeypatch removes them again after the test
        monkeypatch.setenv(name, "unset")
    worker = TrainWorker(rank=0, world_size=1, environment=variables)
    assert not dist.is_initialized() and worker.flight_recorder().recorder is None
    seen = worker.environment()
    assert {name: seen[name] for name in variables} == variables
    assert directory.is_dir()


# ------------------------------------------------------------------ the timeouts' order
@pytest.mark.parametrize("step", [0.5, 6, 60, 300, 3600])
def test_the_kill_comes_after_the_dumps_and_before_the_collective_timeout(step) -> None:
    cluster = ClusterOptions(step_timeout_seconds=step)
    assert cluster.dump_grace_seconds == min(30, step / 4)
    assert step < cluster.kill_deadline_seconds < cluster.collective_timeout_seconds


def test_a_dump_grace_past_the_collective_timeout_is_refused_in_one_line() -> None:
    ok = ClusterOptions(step_timeout_seconds=60, hang_dump_seconds=59)
    assert ok.kill_deadline_seconds == 119 < ok.collective_timeout_seconds == 120
    message = ("cluster.hang_dump_seconds: 60 would kill a hung step's workers 120 s into "
               "it, not before their collective timeout (120 s = 2 x "
               "cluster.step_timeout_seconds), when NCCL's watchdog aborts them itself; use "
               "less than 60")
    with pytest.raises(ValueError) as info:
        ClusterOptions(step_timeout_seconds=60, hang_dump_seconds=60)
    assert str(info.value) == message
    with pytest.raises(JobSpecError) as info:
        parse_job_spec({"model": {"preset": "debug"},
                        "cluster": {"step_timeout_seconds": 60, "hang_dump_seconds": 60}})
    assert message in str(info.value) and "\n" not in str(info.value).strip()


# ------------------------------------------------------------------ the record
def rank_dump_with_one_pending(rank: int, world: int) -> WorkerDump:
    """Both ranks finish one all-reduce; rank 1 then starts a second, which rank 0 joins only
    once rank 1's worker has dumped its recorder (a barrier on a side group says so). Each
    returns its dump, taken by the worker actor's own method."""
    worker = TrainWorker(rank=rank, world_size=world)
    side = dist.new_group([0, 1], backend="gloo")
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if rank == 1:
        pending = dist.all_reduce(tensor, async_op=True)
        dump = worker.flight_recorder()
        dist.barrier(group=side)
        pending.wait()
        return dump
    dist.barrier(group=side)
    dist.all_reduce(tensor)
    time.sleep(0.5)  # gloo retires a finished entry from its own thread, just after the op
    return worker.flight_recorder()


@pytest.fixture(scope="module")
def real_dumps() -> list[WorkerDump]:
    return run_gloo_ranks(2, rank_dump_with_one_pending, timeout_seconds=240)


def _record(run_dir: Path) -> JobRecord:
    job = JobOptions(name="hang", train=tiny_options(str(run_dir), parallel={"cp": 2}),
                     cluster=ClusterOptions(step_timeout_seconds=6),
                     metrics=MetricsOptions(port=None))
    return JobRecord(job, run_dir, metrics=None)


def _events(run_dir: Path) -> list[str]:
    return [json.loads(line)["message"]
            for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_gloo_records_what_a_rank_waits_for(real_dumps) -> None:
    """torch 2.13 records gloo's collectives too: rank 1's dump has the all-reduce its peer
    had not joined, unfinished; rank 0's, both finished."""
    recorders = [dump.recorder for dump in real_dumps]
    pending = [e for e in pickle.loads(recorders[1])["entries"] if not e["retired"]]
    assert [(e["profiling_name"], e["collective_seq_id"]) for e in pending] == [
        ("gloo:all_reduce", 2)]
    # with the innermost caller in ringray's code (here the launcher of the test's ranks)
    assert pending_collective(recorders[1]).startswith(
        "waits in gloo:all_reduce (collective 2, scheduled) at ringray/bench/gloo_ranks.py:")
    assert pending_collective(recorders[0]).startswith("has nothing pending (the last: ")
    assert pending_collective(b"not a dump").startswith("sent an unreadable dump")


def test_a_workers_threads_say_where_they_are() -> None:
    """Every other thread's stack, by name; the caller's own is left out. A thread in
    ringray's code outside the service is where a stuck call is."""
    import threading

    release = threading.Event()
    waiter = threading.Thread(target=release.wait, name="the-waiter", daemon=True)
    waiter.start()
    try:
        stacks, stuck_at = thread_stacks()
    finally:
        release.set()
        waiter.join()
    assert "thread the-waiter:" in stacks and "in wait" in stacks
    assert "test_a_workers_threads_say_where_they_are" not in stacks
    assert stuck_at is None  # no thread in ringray's code here
    dump = WorkerDump(recorder=None, stacks=stacks, stuck_at="ringray/attention/comm.py:1 (f)")
    assert rank_summary(dump) == ("has no process group yet, stuck at "
                                  "ringray/attention/comm.py:1 (f)")


def test_the_record_writes_the_dumps_and_one_event(tmp_path, real_dumps) -> None:
    """Ranks 0 and 1 answered, rank 2 did not; NCCL's watchdog had written a dump of its
    own there (here rank 0's real one under NCCL's name): files, and one line saying all."""
    run_dir = tmp_path / "run"
    record = _record(run_dir)
    directory = recorder_directory(run_dir, "ringray-hang-20261129T101500")
    directory.mkdir(parents=True)
    (directory / f"{NCCL_DUMP_PREFIX}0").write_bytes(real_dumps[0].recorder)
    line = record.flight_recorder(directory, {0: real_dumps[0], 1: real_dumps[1]}, ranks=3,
                                  waited_seconds=1.5, what="a step")
    for rank, dump in enumerate(real_dumps):
        assert (directory / f"rank_{rank}").read_bytes() == dump.recorder
        assert (directory / f"stacks_{rank}.txt").read_text() == dump.stacks
    done, waiting = (rank_summary(dump) for dump in real_dumps)
    assert waiting.startswith("waits in gloo:all_reduce (collective 2, scheduled)")
    assert line == (
        f"flight recorder after a step hung: rank(s) 0, 1 dumped to {directory} (rank_<r>, "
        f"stacks_<r>.txt); rank 0 {done}; rank 1 {waiting}; NCCL's own dumps there: "
        f"nccl_rank_0; rank(s) 2 did not answer within 1.5 s")
    assert _events(run_dir)[-1] == line

    nothing = recorder_directory(run_dir, "ringray-hang-20261129T103000")
    line = record.flight_recorder(nothing, {}, ranks=2, waited_seconds=1.5,
                                  what="a checkpoint")
    assert line == (f"flight recorder after a checkpoint hung: rank(s) 0, 1 did not answer "
                    f"within 1.5 s; no dump appeared in {nothing}")
    assert _events(run_dir)[-1] == line


# ------------------------------------------------------------------ end to end
@pytest.fixture()
def nodes(local_cluster):
    yield local_cluster
    local_cluster.remove_all()


EVENT = "flight recorder after a "


@pytest.mark.timeout(600)
def test_a_hung_step_leaves_every_live_workers_dump(nodes, tmp_path) -> None:
    """Rank 0 of a 2-worker gloo job stopped (SIGSTOP) after step 2: at the step timeout
    (6 s; the stop may land in a checkpoint, which has the same timeout) the controller asks
    both workers for their evidence and waits the grace (1.5 s): rank 1's recorder and
    stacks, taken while it waits on rank 0, are in the run directory and the event says
    where it is stuck; rank 0 did not answer."""
    tag = "slot_flight_recorder"
    nodes.add_node(tag, slots=2)
    run_dir = tmp_path / "ray"
    controller = start_job("hang-dump", job_options(str(run_dir), train={"steps": 40}),
                           cluster_options(tag, step_timeout_seconds=6))
    status = wait_until(controller, lambda s: s.step >= 2, timeout=120, what="step 2")
    stopped = status.workers[0].pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        status = wait_until(  # the stop lands in a step or in a checkpoint
            controller, lambda s: any(e.message.startswith(EVENT) for e in s.events),
            timeout=120, what="the flight recorder's event")
        controller.stop.remote()
        finish(controller)
    finally:
        try:  # the controller killed it; make sure, since a stopped process ignores the rest
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass
    line = next(e.message for e in status.events if e.message.startswith(EVENT))
    directory = Path(line.split(" dumped to ")[1].split(" (rank_<r>")[0])
    assert directory.parent == run_dir / "flight-recorder", line
    # Rank 1 waits on rank 0 in the ring's exchange (gloo's sends and receives are not in
    # its recorder) or in a collective (which is, e.g. a checkpoint's all-gather): its stack
    # says where either way.
    assert "rank(s) 1 dumped to" in line and ", stuck at ringray/train/" in line or \
        ", stuck at ringray/attention/" in line, line
    assert "rank(s) 0 did not answer within 1.5 s" in line, line
    recorder = pickle.loads((directory / "rank_1").read_bytes())
    assert recorder["entries"] and recorder["entries"][-1]["profiling_name"].startswith("gloo:")
    assert "ringray/train/" in (directory / "stacks_1.txt").read_text()
    assert not (directory / "rank_0").exists()


def test_worker_actors_of_an_nccl_job_get_the_recorders_settings(nodes, tmp_path) -> None:
    """A GPU job's worker actors (on nodes declaring fake GPUs: no device is touched) run
    with NCCL's dump pointed into this start's directory of the run; the same job on CPU
    workers only sizes the recorder."""
    import ray

    from ringray.cluster.worker_group import RayWorkerGroup

    tag = "slot_recorder_environment"
    node = nodes.cluster.add_node(num_cpus=2, num_gpus=2, resources={tag: 2})
    nodes.cluster.wait_for_nodes()
    nodes.nodes.append(node)
    seen = {}
    for accelerator, resources in (("gpu", {"GPU": 1, tag: 1}), ("cpu", {"CPU": 1, tag: 1})):
        job = JobOptions(
            name=f"recorder-{accelerator}",
            train=job_options(str(tmp_path / accelerator), parallel={"cp": 2}),
            cluster=cluster_options(tag, accelerator=accelerator, worker_resources=resources),
            metrics=MetricsOptions(port=None))
        group = RayWorkerGroup(job, JobRecord(job, tmp_path / accelerator, metrics=None),
                               should_stop=lambda: False)
        try:
            group._create_workers(group.plan((1,), avoid=frozenset()))
            seen[accelerator] = (group.recorder_dir,
                                 ray.get([w.environment.remote() for w in group.workers]))
        finally:
            group.teardown()
    directory, environments = seen["gpu"]
    assert directory.parent == tmp_path / "gpu" / "flight-recorder"
    assert directory.name.startswith("ringray-recorder-gpu-")
    wanted = recorder_environment("nccl", directory=directory, dump_seconds=15)  # 60 s / 4
    for environment in environments:
        assert {name: environment[name] for name in wanted} == wanted
    assert directory.is_dir()  # made by the workers, for NCCL's own dumps
    _, environments = seen["cpu"]
    for environment in environments:
        assert environment["TORCH_FR_BUFFER_SIZE"] == str(RECORDER_ENTRIES)
        assert not set(NCCL_ONLY) & set(environment)
