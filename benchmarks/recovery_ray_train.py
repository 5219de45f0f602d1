"""The Ray Train v2 baseline of ``benchmarks/recovery.py``: the same job under a
``TorchTrainer`` with ``FailureConfig(max_failures=…)`` and Ray Train's default health checks.

Its train loop (:func:`ray_train_loop`) builds the same :class:`~ringray.train.Trainer` as
ringray's workers, restores the newest complete checkpoint from a
:class:`~ringray.train.CheckpointStore`, steps, checkpoints and ``ray.train.report``s; rank 0
logs each step's wall time to a JSONL file, and a ``UserCallback`` on Ray Train's controller
logs when it saw the workers' failure. The figures are read back from that log.

**replicas** (:func:`run_ray_train_torchft`): a ``TorchTrainer`` with ``TorchftConfig``
(Ray Train's torchft backend: a Lighthouse actor on the controller's node, a process group
per replica group, a failed replica group replaced alone, in the old placement group's
bundles) and two workers, each a replica group of one (the only size Ray 2.60's worker group
makes) holding a whole node. Its train loop (:func:`ray_train_torchft_loop`) builds the same
:class:`~ringray.train.Trainer` with a :class:`~ringray.train.replicas.ReplicaSync` over the
Lighthouse Ray Train started (``TORCHFT_LIGHTHOUSE``) and the replica group's own store
(``MASTER_ADDR``/``MASTER_PORT``), with no checkpoint restored: a replacement heals from the
live peer at its first step, as ringray's does. Every rank logs each step with its replica
fields; a ``ControllerCallback`` logs each resize decision (the first after the kill is the
replacement's start).

This module imports without Ray Train installed (:func:`ray_train_missing` says whether it
can run). ``benchmarks/`` is not an importable package on Ray's workers, so this module and
``recovery_common`` are registered with Ray's cloudpickle to be pickled *by value*: the train
loop and the callback travel to Ray Train's workers and controller as code, not as a
reference to a module those processes could not import.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import recovery_common
from ray import cloudpickle
from recovery_common import (
    LOST_GROUP,
    REPLICAS,
    SLOT_RESOURCE,
    BenchNodes,
    Log,
    RecoveryBenchOptions,
    RecoveryResult,
    after_detection,
    bench_train_options,
    lighthouse_options,
    replica_figures,
    replica_result,
    replica_timeouts,
    tail_done,
    wait_for,
)

from ringray.train import CheckpointStore, Trainer, TrainOptions

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(recovery_common)

RAY_TRAIN_MISSING = (
    "Ray Train is not installed: its half of the benchmark needs the `bench` extra "
    "(pip install -e '.[bench]', i.e. ray[train]); run with --skip-ray-train to measure "
    "ringray alone."
)


def ray_train_missing() -> str | None:
    """Why Ray Train cannot run here, or ``None`` when it can."""
    try:
        import ray.train  # noqa: F401
        from ray.train.torch import TorchTrainer  # noqa: F401
    except ImportError:
        return RAY_TRAIN_MISSING
    return None


def _append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps(record) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a log the workers are appending to (a last line still being
    written is left for the next read)."""
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _stop_requested(config: dict) -> bool:
    """The harness gave up on this run: the train loops return, so that ``fit()`` ends
    before the cluster is shut down under it (Ray ends a driver whose thread still waits on
    a controller that is gone)."""
    return os.path.exists(config["stop_path"])


def _stop_and_join(thread: threading.Thread, stop_path: Path, timeout: float) -> None:
    if thread.is_alive():
        stop_path.touch()
        thread.join(timeout=timeout)


def ray_train_loop(config: dict) -> None:
    """Each Ray Train worker's loop: the same Trainer and checkpoints as ringray's workers.

    Every rank logs ``{"event": "start", ...}`` once its trainer is built and restored;
    rank 0 logs ``{"step", "time"}`` after each step.
    """
    import ray.train

    options: TrainOptions = config["options"]
    events: str = config["events_path"]
    rank = ray.train.get_context().get_world_rank()
    trainer = Trainer(options)
    store = CheckpointStore(options.checkpoint_location)
    latest = store.latest()
    if latest is not None:
        trainer.load_checkpoint(store, latest)
    _append_jsonl(events, {"event": "start", "rank": rank, "restored_step": trainer.step_count,
                           "node_id": ray.get_runtime_context().get_node_id(),
                           "time": time.time()})
    steps, interval = options.train.steps, options.checkpoint.interval
    while trainer.step_count < steps and not _stop_requested(config):
        stats = trainer.step()
        if rank == 0:
            _append_jsonl(events, {"step": stats.step, "time": time.time()})
        if (interval and stats.step % interval == 0) or stats.step == steps:
            trainer.save_checkpoint(store)
            ray.train.report({"step": stats.step, "loss": stats.loss})


def failure_clock(events_path: str):
    """A Ray Train ``UserCallback`` (it runs on Ray Train's controller) that logs when the
    controller saw a worker group's failure. Built here so that this module imports without
    Ray Train installed."""
    from ray.train import UserCallback

    class FailureClock(UserCallback):
        def after_exception(self, run_context, worker_exceptions) -> None:
            first = next(iter(worker_exceptions.values()), None)
            _append_jsonl(events_path, {"event": "failure_seen", "time": time.time(),
                                        "error": repr(first)[:300]})

    return FailureClock()


def run_ray_train(options: RecoveryBenchOptions, nodes: BenchNodes, work_dir: Path,
                  log: Log) -> RecoveryResult:
    """The job under Ray Train v2's ``TorchTrainer`` (default health checks), its ``fit()``
    on a background thread while this thread kills the node."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    work = work_dir / "ray_train"
    work.mkdir(parents=True, exist_ok=True)
    events = work / "events.jsonl"
    stop = work / "stop"
    train = bench_train_options(options, str(work / "run"))
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"options": train, "events_path": str(events),
                           "stop_path": str(stop)},
        scaling_config=ScalingConfig(num_workers=2,
                                     resources_per_worker={"CPU": 1, SLOT_RESOURCE: 1}),
        run_config=RunConfig(name="recovery-bench", storage_path=str(work / "storage"),
                             failure_config=FailureConfig(max_failures=options.max_failures),
                             callbacks=[failure_clock(str(events))]),
    )
    log("Ray Train v2: starting the job")
    thread, outcome = _start_fit(trainer, "ray-train-fit")
    try:
        return _measure_ray_train(options, nodes, events, thread, outcome, log)
    finally:
        _stop_and_join(thread, stop, options.finish_timeout_seconds)


def _start_fit(trainer, name: str) -> tuple[threading.Thread, dict]:
    """``trainer.fit()`` on a daemon thread; the dict gets ``ok`` or its ``error`` (one
    line), so a failed run is reported rather than raised out of the thread."""
    outcome: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
            outcome["ok"] = True
        except BaseException as exc:  # noqa: B036 — reported, not swallowed
            outcome["error"] = f"{type(exc).__name__}: {exc}"[:300]

    thread = threading.Thread(target=fit, name=name, daemon=True)
    thread.start()
    return thread, outcome


def _measure_ray_train(options: RecoveryBenchOptions, nodes: BenchNodes, events: Path,
                       thread: threading.Thread, outcome: dict, log: Log) -> RecoveryResult:
    def last_step() -> int:
        return max((r["step"] for r in _read_jsonl(events) if "step" in r), default=0)

    if not wait_for(lambda: last_step() >= options.kill_after_step or not thread.is_alive(),
                    timeout=options.start_timeout_seconds) or not thread.is_alive():
        return ray_train_result(_read_jsonl(events), None, outcome, options.steps,
                                note=f"step {options.kill_after_step} not reached")
    starts = [r for r in _read_jsonl(events) if r.get("event") == "start"]
    ring_node = next(r["node_id"] for r in reversed(starts) if r["rank"] == 0)
    log(f"Ray Train v2: killing the ring's node at step {last_step()}")
    killed_at = nodes.kill_and_replace(nodes.by_id(ring_node))

    def stepped_after_restart() -> bool:
        return recovery_figures(_read_jsonl(events), killed_at)["first_step_at"] is not None

    recovered = wait_for(lambda: stepped_after_restart() or not thread.is_alive(),
                         timeout=options.recovery_timeout_seconds)
    if recovered:
        thread.join(timeout=options.finish_timeout_seconds)
    note = "" if not thread.is_alive() else "fit() still running when the harness gave up"
    return ray_train_result(_read_jsonl(events), killed_at, outcome, options.steps, note=note)


def recovery_figures(records: list[dict], killed_at: float) -> dict:
    """From a Ray Train run's event log: when the first restart after ``killed_at`` finished
    its first step, the failure's detection time, the steps lost and the restarts.

    The restart is rank 0's first ``start`` record after the kill; steps lost are the last
    step logged before that start minus the step it restored.
    """
    rank0_starts = [r for r in records if r.get("event") == "start" and r["rank"] == 0]
    restart = next((r for r in rank0_starts if r["time"] > killed_at), None)
    seen = next((r for r in records
                 if r.get("event") == "failure_seen" and r["time"] >= killed_at), None)
    figures = {"first_step_at": None, "detected_at": seen["time"] if seen else None,
               "ready_at": restart["time"] if restart else None,
               "steps_lost": None, "restarts": max(len(rank0_starts) - 1, 0),
               "failure": seen["error"] if seen else None}
    if restart is None:
        return figures
    before = [r["step"] for r in records if "step" in r and r["time"] < restart["time"]]
    after = [r["time"] for r in records if "step" in r and r["time"] > restart["time"]]
    figures["steps_lost"] = max(before, default=0) - restart["restored_step"]
    figures["first_step_at"] = min(after) if after else None
    return figures


def ray_train_result(records: list[dict], killed_at: float | None, outcome: dict,
                     total_steps: int, *, note: str = "") -> RecoveryResult:
    final_step = max((r["step"] for r in records if "step" in r), default=0)
    figures = recovery_figures(records, killed_at) if killed_at is not None else {}
    first_step_at, detected_at = figures.get("first_step_at"), figures.get("detected_at")
    ready_at = figures.get("ready_at")
    notes = [note] if note else []
    if "error" in outcome:
        notes.append(f"fit() raised {outcome['error']}")
    first = None if first_step_at is None else first_step_at - killed_at
    detected = None if detected_at is None else detected_at - killed_at
    return RecoveryResult(
        system="Ray Train v2",
        death_to_first_step_seconds=first,
        detection_seconds=detected,
        after_detection_seconds=after_detection(first, detected),
        ready_seconds=None if ready_at is None else ready_at - killed_at,
        steps_lost=figures.get("steps_lost"),
        restarts=figures.get("restarts", 0),
        final_step=final_step,
        finished=outcome.get("ok", False) and final_step >= total_steps,
        note="; ".join(notes),
    )


# --------------------------------------------------------------------- replicas
SYSTEM_TORCHFT = "Ray Train v2 + torchft"


def ray_train_torchft_loop(config: dict) -> None:
    """Each Ray Train worker's loop under ``TorchftConfig``: one replica group (this worker
    alone), the same Trainer and torchft link as a ringray replica group's ranks. Every rank
    logs ``{"event": "start", ...}`` once its trainer is built, and each step it ran
    (committed or not) with its replica fields; world rank 0 checkpoints every
    ``checkpoint.interval`` committed steps."""
    import os

    import ray.train

    from ringray.train.replicas import ReplicaMembership, ReplicaSync

    options: TrainOptions = config["options"]
    events: str = config["events_path"]
    rank = ray.train.get_context().get_world_rank()
    collective, quorum = config["timeouts"]
    group = ReplicaMembership(index=rank, count=options.parallel.dp_replicate,
                         lighthouse=os.environ["TORCHFT_LIGHTHOUSE"],
                         store=(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                         timeout_seconds=collective, quorum_timeout_seconds=quorum)
    trainer = Trainer(options, replicas=ReplicaSync(group))
    store = CheckpointStore(options.checkpoint_location)
    _append_jsonl(events, {"event": "start", "rank": rank, "restored_step": 0,
                           "node_id": ray.get_runtime_context().get_node_id(),
                           "time": time.time()})
    steps, interval = options.train.steps, options.checkpoint.interval
    try:
        while trainer.step_count < steps and not _stop_requested(config):
            stats = trainer.step()
            _append_jsonl(events, {
                "rank": rank, "step": stats.step, "time": time.time(),
                "committed": stats.committed,
                "replicas_participating": stats.replicas_participating,
                "samples_dropped": stats.samples_dropped, "healed": stats.healed,
                "heal_seconds": stats.heal_seconds, "quorum_seconds": stats.quorum_seconds,
                "step_seconds": stats.step_seconds})
            if rank == 0 and stats.committed and interval and stats.step % interval == 0:
                trainer.save_checkpoint(store)
    finally:
        trainer.replicas.shutdown()


def resize_clock(events_path: str):
    """A ``ControllerCallback`` (Ray Train internal; ``RunConfig.callbacks`` passes it to
    the controller) that logs each resize decision the controller executes: the first start,
    and each replacement of a replica group."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class ResizeClock(ControllerCallback):
        def before_controller_execute_resize_decision(self, decision) -> None:
            _append_jsonl(events_path, {"event": "resize", "time": time.time(),
                                        "decision": repr(decision)[:200]})

    return ResizeClock()


def run_ray_train_torchft(options: RecoveryBenchOptions, nodes: BenchNodes, work_dir: Path,
                          log: Log) -> RecoveryResult:
    """Ray Train v2 with ``TorchftConfig``: two replica groups of one worker, a node each,
    and the spare node; rank 1's node is killed, no node added."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    work = work_dir / "ray_train_torchft"
    work.mkdir(parents=True, exist_ok=True)
    events = work / "events.jsonl"
    stop = work / "stop"
    train = bench_train_options(options, str(work / "run"), replicas=REPLICAS, cp=1)
    slots = options.slots_per_node  # one replica group (one worker) holds a whole node
    trainer = TorchTrainer(
        ray_train_torchft_loop,
        train_loop_config={"options": train, "events_path": str(events),
                           "timeouts": replica_timeouts(), "stop_path": str(stop)},
        scaling_config=ScalingConfig(num_workers=REPLICAS, resources_per_worker={
            "CPU": slots, SLOT_RESOURCE: slots}),
        torch_config=TorchftConfig(lighthouse_kwargs=lighthouse_options(options),
                                   backend="gloo"),
        run_config=RunConfig(name="recovery-bench-torchft", storage_path=str(work / "storage"),
                             failure_config=FailureConfig(max_failures=options.max_failures),
                             callbacks=[failure_clock(str(events)),
                                        resize_clock(str(events))]),
    )
    log(f"{SYSTEM_TORCHFT}: starting the job")
    thread, outcome = _start_fit(trainer, "ray-train-torchft-fit")
    try:
        return _measure_torchft(options, nodes, events, stop, thread, outcome,
                                train.train.steps, log)
    finally:
        _stop_and_join(thread, stop, options.finish_timeout_seconds)


def _measure_torchft(options: RecoveryBenchOptions, nodes: BenchNodes, events: Path,
                     stop_path: Path, thread: threading.Thread, outcome: dict,
                     total_steps: int, log: Log) -> RecoveryResult:
    def rank0_steps() -> list[tuple[float, dict]]:
        return [(r["time"], r) for r in _read_jsonl(events)
                if r.get("rank") == 0 and "step" in r]

    def last_step() -> int:
        return max((s["step"] for _, s in rank0_steps() if s["committed"]), default=0)

    if not wait_for(lambda: last_step() >= options.kill_after_step or not thread.is_alive(),
                    timeout=options.start_timeout_seconds) or not thread.is_alive():
        return torchft_result(_read_jsonl(events), None, outcome, total_steps,
                              note=f"step {options.kill_after_step} not reached")
    starts = [r for r in _read_jsonl(events) if r.get("event") == "start"]
    doomed = next(r["node_id"] for r in reversed(starts) if r["rank"] == LOST_GROUP)
    if doomed in {r["node_id"] for r in starts if r["rank"] != LOST_GROUP}:
        return torchft_result(_read_jsonl(events), None, outcome, total_steps,
                              note="the replica groups share a node")
    log(f"{SYSTEM_TORCHFT}: killing replica group {LOST_GROUP}'s node at step {last_step()}")
    killed_at = nodes.kill_and_replace(nodes.by_id(doomed), replace=False)

    def rejoined() -> bool:
        return replica_figures(rank0_steps(), killed_at)["rejoined_at"] is not None

    stopped = False
    if wait_for(lambda: rejoined() or not thread.is_alive(),
                timeout=options.recovery_timeout_seconds):
        wait_for(lambda: tail_done(replica_figures(rank0_steps(), killed_at), options)
                 or not thread.is_alive(), timeout=options.finish_timeout_seconds)
        if thread.is_alive() and tail_done(replica_figures(rank0_steps(), killed_at), options):
            log(f"{SYSTEM_TORCHFT}: stopping the job, {options.replica_tail_steps} steps "
                f"after the replacement's first")
            stopped = True
            stop_path.touch()
        thread.join(timeout=options.finish_timeout_seconds)
    note = "" if not thread.is_alive() else "fit() still running when the harness gave up"
    return torchft_result(_read_jsonl(events), killed_at, outcome, total_steps,
                          stopped=stopped, note=note)


def torchft_result(records: list[dict], killed_at: float | None, outcome: dict,
                   total_steps: int, *, stopped: bool = False,
                   note: str = "") -> RecoveryResult:
    """The figures of the replicas scenario from the Ray Train run's event log: rank 0's
    steps (the survivor's), the replacement's ``start``, the controller's records."""
    notes = [note] if note else []
    if "error" in outcome:
        notes.append(f"fit() raised {outcome['error']}")
    steps = [(r["time"], r) for r in records if r.get("rank") == 0 and "step" in r]
    if killed_at is None:
        final = max((s["step"] for _, s in steps if s["committed"]), default=0)
        return RecoveryResult(system=SYSTEM_TORCHFT, scenario="replicas",
                              death_to_first_step_seconds=None, detection_seconds=None,
                              ready_seconds=None, steps_lost=None, restarts=0,
                              final_step=final, finished=False, note="; ".join(notes))
    after = [r for r in records if r.get("time", 0) >= killed_at]
    seen = next((r for r in after if r.get("event") == "failure_seen"), None)
    resize = next((r for r in after if r.get("event") == "resize"), None)
    start = next((r for r in after if r.get("event") == "start" and r["rank"] == LOST_GROUP),
                 None)
    healed = next((r for r in after if r.get("rank") == LOST_GROUP and r.get("healed")), None)
    rank0_starts = [r for r in records if r.get("event") == "start" and r["rank"] == 0]
    figures = replica_figures(steps, killed_at)
    return replica_result(
        SYSTEM_TORCHFT, figures, killed_at=killed_at,
        detected_at=None if seen is None else seen["time"],
        ready_at=None if start is None else start["time"],
        replacement_started_at=None if resize is None else resize["time"],
        restarts=max(len(rank0_starts) - 1, 0),
        finished=outcome.get("ok", False) and (stopped or figures["final_step"] >= total_steps),
        stopped=stopped,
        note="; ".join(notes),
        details={"failure": None if seen is None else seen["error"],
                 "healed_step": None if healed is None else healed["step"],
                 "heal_seconds": None if healed is None else healed["heal_seconds"],
                 "resizes": sum(1 for r in records if r.get("event") == "resize")},
    )
