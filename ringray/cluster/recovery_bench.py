"""Recovery from a node's death: ringray's service against Ray Train v2, side by side.

(A benchmark, behind ``benchmarks/recovery.py``; it lives in ``ringray.cluster`` because that
is the package's one home of Ray code.)

    results = run_recovery_bench(RecoveryBenchOptions(work_dir="/tmp/recovery"))
    Console().print(recovery_table(results))

For each system, on a local multi-node Ray cluster of its own (``ray.cluster_utils.Cluster``
on this machine: a head node with no worker slots and two worker nodes with two slots
each), one CP=2 ring (two workers, dp=1) trains the same small model with the same
options. After ``kill_after_step`` steps the node running the ring is killed
(``remove_node(allow_graceful=False)``) at a wall time T0 and a replacement node joins at
once; the ring can restart on the surviving node. Measured per system:

- seconds from T0 to the first training step completed after the restart (the figure a
  user waits for), and from T0 to the moment the orchestrator noticed the failure;
- steps lost: the last step done before the failure minus the step of the checkpoint the
  restart restored (the work done again);
- restarts, and the final step reached.

**ringray**: :func:`ringray.cluster.launch.start_controller` with its default detection
settings; the figures come from the controller's ``Restart`` record (``detected_at``,
``recovery_seconds`` = detection → first step, ``lost_steps``).

**Ray Train v2**: a ``TorchTrainer`` with ``FailureConfig(max_failures=…)`` and Ray Train's
default health checks. Its train loop builds the same :class:`~ringray.train.Trainer` (Ray
Train has already formed the gloo process group), restores the newest complete checkpoint
from a :class:`~ringray.train.CheckpointStore` at a shared path, steps, checkpoints every
``checkpoint_interval`` steps with ``trainer.save_checkpoint`` and ``ray.train.report``s; rank
0 appends ``{"step", "time"}`` per step to a JSONL file, and a ``UserCallback`` on Ray Train's
controller records when it saw the workers' failure.

Both sides do the same training and the same checkpoint I/O through the same store, so the
difference measured is the orchestration (noticing the death, tearing down, placing and
starting a new worker group), not the storage. Both clusters run GCS health checks every
second with a failure threshold of 3, so Ray marks a dead node dead in about 3 s for either
system: that bounds how soon either can notice.

Environment: Ray must have been imported with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
``RAY_AUTH_MODE=disabled`` (and ``RAY_TRAIN_V2_ENABLED=1`` for Ray Train v2) already set;
``benchmarks/recovery.py`` sets them before anything imports Ray. This module never reads
or sets environment variables itself.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from rich.table import Table

from ringray.cluster.launch import NAMESPACE, release, start_controller
from ringray.cluster.options import ClusterOptions
from ringray.cluster.status import JobStatus
from ringray.model import model_preset
from ringray.train import CheckpointStore, OptimizerOptions, Trainer, TrainOptions

HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
SLOT_RESOURCE = "bench_slot"  # the custom resource a worker slot offers; workers ask for one
RAY_TRAIN_MISSING = (
    "Ray Train is not installed: its half of the benchmark needs the `bench` extra "
    "(pip install -e '.[bench]', i.e. ray[train]); run with --skip-ray-train to measure "
    "ringray alone."
)
_POLL_SECONDS = 0.1  # how often the driver looks at a job's progress


@dataclass(frozen=True, kw_only=True)
class RecoveryBenchOptions:
    work_dir: str  # run directories, checkpoints, step logs and Ray Train's storage
    steps: int = 30
    kill_after_step: int = 15  # the node is killed once this many steps are done
    checkpoint_interval: int = 10
    seq_len: int = 1024  # ~0.1 s steps on two CPU cores: "the first step after" is sharp
    slots_per_node: int = 2
    max_failures: int = 3  # either system's retry budget
    start_timeout_seconds: float = 180.0  # to reach kill_after_step
    recovery_timeout_seconds: float = 180.0  # from the death to the first step after it
    finish_timeout_seconds: float = 180.0  # from that step to the job's end
    ray_train: bool = True
    repeats: int = 1  # runs of each system, alternating


@dataclass(frozen=True, kw_only=True)
class RecoveryResult:
    system: str
    run: int = 1  # 1, 2, …; 0 for a summary (medians over the runs)
    death_to_first_step_seconds: float | None  # None: no step after the death within time
    detection_seconds: float | None  # death → the orchestrator saw it; None: not known
    ready_seconds: float | None  # death → the new workers' trainers built and restored
    steps_lost: float | None  # last step before the failure − the step restored
    restarts: float
    final_step: int
    finished: bool  # the job reached its last step
    note: str = ""  # what went wrong, when something did


def bench_train_options(options: RecoveryBenchOptions, run_dir: str) -> TrainOptions:
    """The job both systems run: a two-layer model, one CP=2 ring, float32, SDPA (the
    options of the tests' tiny model, at a longer sequence)."""
    return TrainOptions(
        model=model_preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_hidden=128),
        seq_len=options.seq_len,
        global_batch=2,
        steps=options.steps,
        dp=1,
        cp=2,
        attention_backend="sdpa",
        precision="fp32",
        optimizer=OptimizerOptions(lr=1e-2, warmup_steps=1),
        peak_flops_per_device=1e12,  # a fixed peak: no matmul measurement at each start
        run_dir=run_dir,
        checkpoint_interval=options.checkpoint_interval,
        checkpoint_keep=3,
    )


def ray_train_missing() -> str | None:
    """Why Ray Train cannot run here, or ``None`` when it can."""
    try:
        import ray.train  # noqa: F401
        from ray.train.torch import TorchTrainer  # noqa: F401
    except ImportError:
        return RAY_TRAIN_MISSING
    return None


def run_recovery_bench(
    options: RecoveryBenchOptions, *, log: Callable[[str], None] = print
) -> list[RecoveryResult]:
    """Each system ``options.repeats`` times, alternating (so that a shared machine's
    load drifts over both alike), each run on a fresh local cluster."""
    systems = [("ringray", run_ringray)]
    if options.ray_train:
        missing = ray_train_missing()
        if missing is None:
            systems.append(("Ray Train v2", run_ray_train))
        else:
            log(missing)
    results = []
    for run in range(1, options.repeats + 1):
        for name, measure in systems:
            work_dir = Path(options.work_dir) / f"run{run}"
            log(f"{name}, run {run} of {options.repeats}")
            with local_cluster(slots_per_node=options.slots_per_node) as nodes:
                result = measure(options, nodes, work_dir, log)
            results.append(replace(result, run=run))
    return results


def summarize(results: list[RecoveryResult]) -> list[RecoveryResult]:
    """One row per system: the median of each figure over its runs (``run`` = 0), the
    lowest final step, finished only when every run finished."""
    rows = []
    for system in dict.fromkeys(r.system for r in results):
        runs = [r for r in results if r.system == system]

        def median(field: str, runs=runs):
            values = [getattr(r, field) for r in runs if getattr(r, field) is not None]
            return statistics.median(values) if values else None

        rows.append(RecoveryResult(
            system=system, run=0,
            death_to_first_step_seconds=median("death_to_first_step_seconds"),
            detection_seconds=median("detection_seconds"), ready_seconds=median("ready_seconds"),
            steps_lost=median("steps_lost"), restarts=median("restarts"),
            final_step=min(r.final_step for r in runs),
            finished=all(r.finished for r in runs),
        ))
    return rows


# --------------------------------------------------------------------- the cluster
class BenchNodes:
    """The worker nodes of a bench cluster; add and kill them from the main thread."""

    def __init__(self, cluster: Cluster, slots_per_node: int) -> None:
        self.cluster = cluster
        self.slots_per_node = slots_per_node
        self.nodes: list = []

    def add(self):
        node = self.cluster.add_node(num_cpus=self.slots_per_node,
                                     resources={SLOT_RESOURCE: self.slots_per_node})
        self.nodes.append(node)
        return node

    def by_id(self, node_id: str):
        return next(node for node in self.nodes if node.node_id == node_id)

    def kill_and_replace(self, node) -> float:
        """Kill ``node`` (its raylet and every process on it) and add a replacement; returns
        the wall time just before the kill."""
        killed_at = time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        self.add()
        return killed_at


@contextmanager
def local_cluster(*, slots_per_node: int) -> Iterator[BenchNodes]:
    """A head node with no worker slots and two worker nodes, connected; always shut down."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False,
                        "_system_config": HEALTH_CHECKS},
    )
    try:
        nodes = BenchNodes(cluster, slots_per_node)
        nodes.add()
        nodes.add()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE,
                 logging_level=logging.WARNING, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def _wait_for(condition: Callable[[], bool], *, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


# --------------------------------------------------------------------- ringray
def run_ringray(options: RecoveryBenchOptions, nodes: BenchNodes, work_dir: Path,
                log: Callable[[str], None]) -> RecoveryResult:
    """The job under ringray's controller (default detection settings)."""
    train = bench_train_options(options, str(work_dir / "ringray"))
    cluster = ClusterOptions(
        job_name="recovery-bench", cp=2, dp_max=1, dp_min=1,
        worker_resources={"CPU": 1.0, SLOT_RESOURCE: 1.0},
        max_failures=options.max_failures, request_resources=False,
    )
    log("ringray: starting the job")
    controller, _ = start_controller(train, cluster)
    try:
        def reached_kill_step() -> bool:
            status = _ringray_status(controller)
            return status.step >= options.kill_after_step or status.done

        def recovered_or_ended() -> bool:
            status = _ringray_status(controller)
            return status.done or any(r.recovery_seconds is not None for r in status.restarts)

        if not _wait_for(reached_kill_step, timeout=options.start_timeout_seconds):
            return _ringray_gave_up(_ringray_status(controller),
                                    f"step {options.kill_after_step} not reached")
        status = _ringray_status(controller)
        if status.done:
            return _ringray_gave_up(status, f"ended early: {status.state} ({status.error})")
        log(f"ringray: killing the ring's node at step {status.step}")
        killed_at = nodes.kill_and_replace(nodes.by_id(status.workers[0].node_id))
        recovered = _wait_for(recovered_or_ended, timeout=options.recovery_timeout_seconds)
        _wait_for(lambda: _ringray_status(controller).done,
                  timeout=options.finish_timeout_seconds if recovered else 0)
        return ringray_result(_ringray_status(controller), killed_at)
    finally:
        if not _ringray_status(controller).done:
            ray.get(controller.stop.remote())
        release(controller)


def _ringray_status(controller) -> JobStatus:
    return ray.get(controller.status.remote())


def _ringray_gave_up(status: JobStatus, why: str) -> RecoveryResult:
    return RecoveryResult(system="ringray", death_to_first_step_seconds=None,
                          detection_seconds=None, ready_seconds=None, steps_lost=None,
                          restarts=len(status.restarts), final_step=status.step,
                          finished=False, note=why)


def ringray_result(status: JobStatus, killed_at: float) -> RecoveryResult:
    """The figures of the first restart after the kill at ``killed_at``."""
    after = [r for r in status.restarts if r.detected_at >= killed_at]
    finished = status.state == "finished"
    if not after:
        return _ringray_gave_up(status, f"no restart recorded; job {status.state}")
    first = after[0]
    recovered_at = (first.detected_at + first.recovery_seconds
                    if first.recovery_seconds is not None else None)
    # The controller's event for a (re)start, logged once every trainer is built and restored.
    ready_at = next((e.time for e in status.events
                     if e.time >= first.detected_at and e.message.startswith("started ")), None)
    note = "" if finished else f"job {status.state}: {status.error}"
    if first.reason != "node_died":
        note = f"restart reason {first.reason}: {first.detail}; {note}".rstrip("; ")
    return RecoveryResult(
        system="ringray",
        death_to_first_step_seconds=None if recovered_at is None else recovered_at - killed_at,
        detection_seconds=first.detected_at - killed_at,
        ready_seconds=None if ready_at is None else ready_at - killed_at,
        steps_lost=first.lost_steps,
        restarts=len(status.restarts),
        final_step=status.step,
        finished=finished,
        note=note,
    )


# --------------------------------------------------------------------- Ray Train v2
def _append_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps(record) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    while trainer.step_count < options.steps:
        stats = trainer.step()
        if rank == 0:
            _append_jsonl(events, {"step": stats.step, "time": time.time()})
        if stats.step % options.checkpoint_interval == 0 or stats.step == options.steps:
            trainer.save_checkpoint(store)
            ray.train.report({"step": stats.step, "loss": stats.loss})


def _failure_clock(events_path: str):
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
                  log: Callable[[str], None]) -> RecoveryResult:
    """The job under Ray Train v2's ``TorchTrainer`` (default health checks), its ``fit()``
    on a background thread while this thread kills the node."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    work = work_dir / "ray_train"
    work.mkdir(parents=True, exist_ok=True)
    events = work / "events.jsonl"
    train = bench_train_options(options, str(work / "run"))
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"options": train, "events_path": str(events)},
        scaling_config=ScalingConfig(num_workers=2,
                                     resources_per_worker={"CPU": 1, SLOT_RESOURCE: 1}),
        run_config=RunConfig(name="recovery-bench", storage_path=str(work / "storage"),
                             failure_config=FailureConfig(max_failures=options.max_failures),
                             callbacks=[_failure_clock(str(events))]),
    )
    outcome: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
            outcome["ok"] = True
        except BaseException as exc:  # noqa: B036 — reported, not swallowed
            outcome["error"] = f"{type(exc).__name__}: {exc}"[:300]

    log("Ray Train v2: starting the job")
    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()

    def last_step() -> int:
        return max((r["step"] for r in _read_jsonl(events) if "step" in r), default=0)

    if not _wait_for(lambda: last_step() >= options.kill_after_step or not thread.is_alive(),
                     timeout=options.start_timeout_seconds) or not thread.is_alive():
        return ray_train_result(_read_jsonl(events), None, outcome, options.steps,
                                note=f"step {options.kill_after_step} not reached")
    starts = [r for r in _read_jsonl(events) if r.get("event") == "start"]
    ring_node = next(r["node_id"] for r in reversed(starts) if r["rank"] == 0)
    log(f"Ray Train v2: killing the ring's node at step {last_step()}")
    killed_at = nodes.kill_and_replace(nodes.by_id(ring_node))

    def stepped_after_restart() -> bool:
        return recovery_figures(_read_jsonl(events), killed_at)["first_step_at"] is not None

    recovered = _wait_for(lambda: stepped_after_restart() or not thread.is_alive(),
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
    return RecoveryResult(
        system="Ray Train v2",
        death_to_first_step_seconds=None if first_step_at is None else first_step_at - killed_at,
        detection_seconds=None if detected_at is None else detected_at - killed_at,
        ready_seconds=None if ready_at is None else ready_at - killed_at,
        steps_lost=figures.get("steps_lost"),
        restarts=figures.get("restarts", 0),
        final_step=final_step,
        finished=outcome.get("ok", False) and final_step >= total_steps,
        note="; ".join(notes),
    )


# --------------------------------------------------------------------- output
def recovery_table(results: list[RecoveryResult], options: RecoveryBenchOptions) -> Table:
    table = Table(
        title=(f"the CP=2 ring's node killed after step {options.kill_after_step} of "
               f"{options.steps}, checkpoints every {options.checkpoint_interval} steps; "
               "seconds from the death"),
        title_justify="left",
        caption=("GCS health checks every 1 s, 3 misses: Ray marks a dead node dead in ~3 s, "
                 "which bounds detection for both. ready: the new workers' trainers built and "
                 "the checkpoint restored."),
        caption_justify="left",
    )
    many = options.repeats > 1
    columns = ("system", *(("run",) if many else ()), "first step", "detected", "ready",
               "lost steps", "restarts", "final")
    for col in columns:
        table.add_column(col, justify="right", no_wrap=True)
    rows = [*results, *summarize(results)] if many else results
    for index, r in enumerate(rows):
        name = (r.system, str(r.run or "median")) if many else (r.system,)
        final = f"{r.final_step}" + ("" if r.finished else " (unfinished)")
        table.add_row(*name, _seconds(r.death_to_first_step_seconds),
                      _seconds(r.detection_seconds), _seconds(r.ready_seconds),
                      _number(r.steps_lost), _number(r.restarts), final,
                      end_section=many and index == len(results) - 1)
    return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"

