"""Recovery from a node's death: ringray's service against Ray Train v2, side by side.

The shared half of ``benchmarks/recovery.py`` (the command-line script): the options, the
result record, the local multi-node cluster, the jobs both systems run, what is read from
their step logs, and the table. ringray's side is in ``recovery_ringray.py``, Ray Train's in
``recovery_ray_train.py``. Two scenarios:

**restart** (the job restarts from its last checkpoint). For each system, on a local
multi-node Ray cluster of its own (``ray.cluster_utils.Cluster`` on this machine: a head
node with no worker slots and two worker nodes with two slots each), one CP=2 ring (two
workers, dp=1) trains the same small model with the same options. After
``kill_after_step`` steps the node running the ring is killed
(``remove_node(allow_graceful=False)``) at a wall time T0 and a replacement node joins at
once; the ring can restart on the surviving node. Measured per system:

- seconds from T0 to the first training step completed after the restart (the figure a
  user waits for), and from T0 to the moment the orchestrator noticed the failure;
- steps lost: the last step done before the failure minus the step of the checkpoint the
  restart restored (the work done again);
- restarts, and the final step reached.

**ringray**: :func:`ringray.cluster.driver.start_controller` with its default detection
settings; the figures come from the controller's ``Restart`` record (``detected_at``,
``recovery_seconds`` = detection → first step, ``lost_steps``).

**Ray Train v2**: a ``TorchTrainer`` with ``FailureConfig(max_failures=…)`` and Ray Train's
default health checks. Its train loop builds the same :class:`~ringray.train.Trainer` (Ray
Train has already formed the gloo process group), restores the newest complete checkpoint
from a :class:`~ringray.train.CheckpointStore` at a shared path, steps, checkpoints every
``checkpoint.interval`` steps with ``trainer.save_checkpoint`` and ``ray.train.report``s; rank
0 appends ``{"step", "time"}`` per step to a JSONL file, and a ``UserCallback`` on Ray Train's
controller records when it saw the workers' failure.

Both sides do the same training and the same checkpoint I/O through the same store, so the
difference measured is the orchestration (noticing the death, tearing down, placing and
starting a new worker group), not the storage. Both clusters run GCS health checks every
second with a failure threshold of 3, so Ray marks a dead node dead in about 3 s for either
system: that bounds how soon either can notice.

**replicas** (replica groups over torchft: the survivors train on, a replacement heals from
them). Three worker nodes with two slots each and a head node with one CPU (Ray Train's
Lighthouse actor asks for one). ringray runs ``parallel.dp_replicate: 2``: two replica
groups, each a CP=2 ring on a node of its own, the third node spare. Ray Train v2 runs its
``TorchftConfig``, whose worker group makes every worker a replica group of its own (Ray
2.60: "TODO: change after we support replica groups of size > 1"), so its closest shape is
two replica groups of one worker each, each worker holding a whole node's two slots and the
whole sequence (cp=1): the same model, global batch, sequence, rows per replica and
optimizer; per replica the same work, done by one process instead of a ring of two. Both
train through the same :class:`~ringray.train.replicas.ReplicaSync` (torchft's ``Manager``
with the same timeouts, a Lighthouse with the same ``min_replicas``, join and heartbeat
timeouts), so what differs is, again, the orchestration. After ``kill_after_step`` steps the
node of replica group 1 is killed at T0 (no node joins: the spare takes the replacement).
Measured per system, from the committed steps (:func:`replica_figures`):

- the survivors' next committed step: the first step committed after T0 without group 1;
- detection: T0 to the orchestrator's record of the loss (ringray's ``replica group 1
  lost`` event; Ray Train's ``UserCallback.after_exception``);
- ready: T0 to the replacement built (ringray's ``replica group 1 replaced in`` event; Ray
  Train: the new worker's trainer built, before its first quorum);
- the replacement's time: from the orchestrator starting it (ringray: ``_replace``'s start,
  the ``replaced in`` event's time less its seconds; Ray Train: the controller's resize
  decision that replaces the group) to the first step committed with both groups again. The
  spare node is up from the start, so this is placement, worker start, build, heal and step;
- committed steps rolled back (a step logged twice; 0 expected) and samples dropped (the
  sum of ``samples_dropped`` over the steps committed after T0: the lost group's rows of
  the steps it missed).

``steps.jsonl`` holds no wall time (a :class:`~ringray.train.StepStats` has durations only),
so for ringray a thread here stamps each line as it appears (:class:`StepsTail`, every
20 ms); Ray Train's rank 0 stamps its own steps as it logs them.

Environment: Ray must have been imported with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
``RAY_AUTH_MODE=disabled`` (and ``RAY_TRAIN_V2_ENABLED=1`` for Ray Train v2) already set;
``benchmarks/recovery.py`` sets them before anything imports Ray. These helper modules never
read or set environment variables themselves.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from rich.table import Table

from ringray.cluster.driver import NAMESPACE
from ringray.cluster.job_options import ClusterOptions
from ringray.model import model_preset
from ringray.train import (
    CheckpointOptions,
    OptimizerOptions,
    ParallelOptions,
    TrainingOptions,
    TrainOptions,
)

HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
SLOT_RESOURCE = "bench_slot"  # the custom resource a worker slot offers; workers ask for one
POLL_SECONDS = 0.1  # how often the driver looks at a job's progress
TAIL_SECONDS = 0.02  # how often StepsTail looks for new lines of a steps.jsonl
SCENARIOS = ("replicas", "restart")
REPLICAS = 2  # replica groups of the replicas scenario
LOST_GROUP = 1  # the replica group whose node is killed

Log = Callable[[str], None]  # where a system's progress lines go


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
    scenarios: tuple[str, ...] = ("restart",)  # of SCENARIOS, in the order they run
    # The replicas scenario: long enough that the replacement joins well before the end
    # (if the survivors finish first, the replacement never commits a step).
    replica_steps: int = 500
    # ...but once the replacement has committed this many steps with the survivors, the
    # harness stops the job (it has shown what it measures); 0: run to replica_steps
    replica_tail_steps: int = 20
    replica_checkpoint_interval: int = 100
    # The Lighthouse's heartbeat and join timeouts (both systems): ringray's default
    replica_heartbeat_seconds: float = ClusterOptions().replica_heartbeat_seconds


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
    finished: bool  # the job reached its last step (or ended cleanly when stopped)
    note: str = ""  # what went wrong, when something did
    stopped: bool = False  # the harness stopped the job on purpose (replica_tail_steps)
    scenario: str = "restart"  # one of SCENARIOS
    # first step − detection (the survivors' commit after the loss was recorded)
    after_detection_seconds: float | None = None
    # replicas: the replacement's start (placement) → its first step committed with the others
    replacement_seconds: float | None = None
    samples_dropped: float | None = None  # replicas: the sum of samples_dropped
    load: float | None = None  # the machine's 1-minute load average at the run's end
    details: dict = field(default_factory=dict)  # the times behind the figures (JSON only)


def after_detection(first_step: float | None, detected: float | None) -> float | None:
    return None if first_step is None or detected is None else first_step - detected


def bench_train_options(options: RecoveryBenchOptions, run_dir: str, *,
                        replicas: int = 1, cp: int = 2) -> TrainOptions:
    """The job both systems run: a two-layer model, one CP=2 ring, float32, SDPA (the
    options of the tests' tiny model, at a longer sequence). With ``replicas`` (the replicas
    scenario): that many replica groups of one ring of ``cp`` each, the global batch's two
    rows split between them, ``replica_steps`` steps."""
    return TrainOptions(
        model=model_preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_hidden=128),
        parallel=ParallelOptions(dp=1, cp=cp, dp_replicate=replicas, layout="zigzag",
                                 attention_backend="sdpa"),
        train=TrainingOptions(
            seq_len=options.seq_len,
            global_batch=2,
            steps=options.replica_steps if replicas > 1 else options.steps,
            precision="fp32",
            optimizer=OptimizerOptions(lr=1e-2, warmup_steps=1),
            peak_tflops_per_device=1.0,  # a fixed peak: no matmul measurement at each start
        ),
        checkpoint=CheckpointOptions(
            interval=(options.replica_checkpoint_interval if replicas > 1
                      else options.checkpoint_interval), keep=3),
        run_dir=run_dir,
    )


def replica_timeouts() -> tuple[float, float]:
    """``(collective, quorum)`` seconds of a replica group's torchft ``Manager`` as ringray
    sets them from its default ``cluster.step_timeout_seconds``
    (``ReplicatedWorkerGroup._replica``); Ray Train's side uses the same."""
    step_timeout = ClusterOptions().step_timeout_seconds
    return max(1.0, step_timeout / 2), step_timeout


def lighthouse_options(options: RecoveryBenchOptions) -> dict:
    """The Lighthouse's settings, as ringray's ``ReplicatedWorkerGroup`` starts it."""
    heartbeat_ms = round(options.replica_heartbeat_seconds * 1000)
    return {"min_replicas": 1, "join_timeout_ms": heartbeat_ms,
            "heartbeat_timeout_ms": heartbeat_ms}


def summarize(results: list[RecoveryResult]) -> list[RecoveryResult]:
    """One row per system and scenario: the median of each figure over its runs (``run`` =
    0; each figure's median on its own, so "after detection" is the median of the runs'
    differences), the lowest final step, finished only when every run finished."""
    rows = []
    for system, scenario in dict.fromkeys((r.system, r.scenario) for r in results):
        runs = [r for r in results if (r.system, r.scenario) == (system, scenario)]

        def median(name: str, runs=runs):
            values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
            return statistics.median(values) if values else None

        rows.append(RecoveryResult(
            system=system, scenario=scenario, run=0,
            death_to_first_step_seconds=median("death_to_first_step_seconds"),
            detection_seconds=median("detection_seconds"), ready_seconds=median("ready_seconds"),
            after_detection_seconds=median("after_detection_seconds"),
            replacement_seconds=median("replacement_seconds"),
            steps_lost=median("steps_lost"), samples_dropped=median("samples_dropped"),
            restarts=median("restarts"), load=median("load"),
            final_step=min(r.final_step for r in runs),
            finished=all(r.finished for r in runs), stopped=any(r.stopped for r in runs),
        ))
    return rows


# --------------------------------------------------------------------- step logs
class StepsTail:
    """Each line appended to a ``steps.jsonl``, stamped with the wall time it was seen.

    A step's line carries no wall time, so a thread reads the file's new bytes every
    ``TAIL_SECONDS`` and stamps each complete line; a stamp is late by at most that (plus
    this process's scheduling on a loaded machine). A file cut back (a restart, which the
    replicas scenario should never see) is read again from its start, and counted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[tuple[float, dict]] = []
        self.cut_back = 0
        self._offset = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steps-tail", daemon=True)

    def __enter__(self) -> StepsTail:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def _run(self) -> None:
        while not self._stop.wait(TAIL_SECONDS):
            self._read()

    def _read(self) -> None:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return
        if size < self._offset:
            self.cut_back += 1
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        now = time.time()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        self.records.extend((now, json.loads(line)) for line in lines if line.strip())

    def snapshot(self) -> list[tuple[float, dict]]:
        return list(self.records)


def replica_figures(steps: list[tuple[float, dict]], killed_at: float,
                    lost: int = LOST_GROUP, healed_step: int | None = None) -> dict:
    """From ``(time, step record)`` pairs in log order (a ``StepStats``'s fields:
    ``step``, ``committed``, ``replicas_participating``, ``samples_dropped``, ``healed``):
    when the survivors first committed a step after ``killed_at`` (without group ``lost``,
    or with its replacement healed into that very step: a standby that takes the place
    before the survivors' next quorum forms), when a step was first committed with the
    replacement (that same step in the second case), the committed steps logged again (a
    step number not above one logged before it), the samples dropped after the death and
    the last step. ``healed_step``: the step the replacement healed into, from the job's
    event (a step record says ``healed`` only when the replacement's call returned with
    the survivors', not when it returned after them)."""

    def healed(s: dict) -> bool:
        return bool(s.get("healed")) or s["step"] == healed_step

    committed = [(t, s) for t, s in steps if s.get("committed", True)]
    after = [(t, s) for t, s in committed if t > killed_at]
    alone = next(((t, s) for t, s in after if lost not in s["replicas_participating"]
                  or healed(s)), None)
    rejoined = None
    if alone is not None:
        rejoined = next(((t, s) for t, s in after
                         if t >= alone[0] and lost in s["replicas_participating"]
                         and (s["step"] > alone[1]["step"] or healed(s))), None)
    rolled_back, newest = 0, 0
    for _, s in committed:
        if s["step"] <= newest:
            rolled_back += 1
        newest = max(newest, s["step"])
    before = [s["step_seconds"] for t, s in committed if t <= killed_at and "step_seconds" in s]
    return {
        "survivors_commit_at": None if alone is None else alone[0],
        "survivors_step": None if alone is None else alone[1]["step"],
        "rejoined_at": None if rejoined is None else rejoined[0],
        "rejoined_step": None if rejoined is None else rejoined[1]["step"],
        "last_step_before": max((s["step"] for t, s in committed if t <= killed_at),
                                default=0),
        "rolled_back": rolled_back,
        # after the death only (a group late to the first quorum also drops its rows)
        "samples_dropped": sum(s.get("samples_dropped", 0) for _, s in after),
        "final_step": newest,
        # the median step time of the last 10 steps before the death, for context
        "step_seconds_before": statistics.median(before[-10:]) if before else None,
    }


def tail_done(figures: dict, options: RecoveryBenchOptions) -> bool:
    """The replacement has committed ``replica_tail_steps`` steps with the survivors: the
    harness may stop the job (never with ``replica_tail_steps`` 0)."""
    rejoined = figures["rejoined_step"]
    return (options.replica_tail_steps > 0 and rejoined is not None
            and figures["final_step"] >= rejoined + options.replica_tail_steps)


def replica_result(system: str, figures: dict, *, killed_at: float,
                   detected_at: float | None, ready_at: float | None,
                   replacement_started_at: float | None, restarts: int, finished: bool,
                   stopped: bool = False, note: str = "",
                   details: dict | None = None) -> RecoveryResult:
    """One run of the replicas scenario, its times made relative to the death."""
    def since(at: float | None, start: float | None = killed_at) -> float | None:
        return None if at is None or start is None else at - start

    first = since(figures["survivors_commit_at"])
    detected = since(detected_at)
    return RecoveryResult(
        system=system, scenario="replicas",
        death_to_first_step_seconds=first, detection_seconds=detected,
        after_detection_seconds=after_detection(first, detected),
        ready_seconds=since(ready_at),
        replacement_seconds=since(figures["rejoined_at"], replacement_started_at),
        steps_lost=figures["rolled_back"], samples_dropped=figures["samples_dropped"],
        restarts=restarts, final_step=figures["final_step"], finished=finished,
        stopped=stopped, note=note,
        details={**figures, "killed_at": killed_at, "detected_at": detected_at,
                 "ready_at": ready_at, "replacement_started_at": replacement_started_at,
                 **(details or {})},
    )


def with_load(result: RecoveryResult) -> RecoveryResult:
    return replace(result, load=os.getloadavg()[0])


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

    def kill_and_replace(self, node, *, replace: bool = True) -> float:
        """Kill ``node`` (its raylet and every process on it) and, with ``replace``, add a
        replacement; returns the wall time just before the kill."""
        killed_at = time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        if replace:
            self.add()
        return killed_at


@contextmanager
def local_cluster(*, slots_per_node: int, worker_nodes: int = 2,
                  head_cpus: int = 0) -> Iterator[BenchNodes]:
    """A head node with no worker slots (``head_cpus`` CPUs, for actors that ask for one)
    and ``worker_nodes`` worker nodes, connected; always shut down."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "include_dashboard": False,
                        "_system_config": HEALTH_CHECKS},
    )
    try:
        nodes = BenchNodes(cluster, slots_per_node)
        for _ in range(worker_nodes):
            nodes.add()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE,
                 logging_level=logging.WARNING, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def wait_for(condition: Callable[[], bool], *, timeout: float) -> bool:
    """Poll ``condition`` until it holds (``True``) or ``timeout`` seconds pass (``False``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


# --------------------------------------------------------------------- output
def recovery_table(results: list[RecoveryResult], options: RecoveryBenchOptions) -> Table:
    replicas = "replicas" in options.scenarios
    restart = "restart" in options.scenarios
    what = []
    if restart:
        what.append(f"restart: the CP=2 ring's node killed after step "
                    f"{options.kill_after_step} of {options.steps}, checkpoints every "
                    f"{options.checkpoint_interval} steps")
    if replicas:
        what.append(f"replicas: replica group {LOST_GROUP}'s node killed after step "
                    f"{options.kill_after_step} of {options.replica_steps}, Lighthouse "
                    f"heartbeat {options.replica_heartbeat_seconds:g} s")
    table = Table(
        title="; ".join(what) + "; seconds from the death",
        title_justify="left",
        caption=(
            "GCS health checks every 1 s, 3 misses: Ray marks a dead node dead in ~3 s. "
            "first step: the first step committed after the death (restart: by the "
            "restarted workers; replicas: by the survivors, without the lost group). "
            "after det.: first step - detected. ready: the new workers' trainers built (and "
            "the checkpoint restored). replaced: the replacement's start to its first step "
            "committed with the others. rolled back: committed steps done again. dropped: "
            "samples not trained on. final (stopped): the harness stopped the job "
            f"{options.replica_tail_steps} steps after the replacement's first. load: "
            "1-minute load average at the run's end."),
        caption_justify="left",
    )
    many = options.repeats > 1
    columns = ("system", "scenario", *(("run",) if many else ()), "first step", "detected",
               "after det.", "ready", "replaced", "rolled back", "dropped", "restarts",
               "final", "load")
    for col in columns:
        table.add_column(col, justify="right", no_wrap=True)
    rows = [*results, *summarize(results)] if many else results
    for index, r in enumerate(rows):
        name = ((r.system, r.scenario, str(r.run or "median")) if many
                else (r.system, r.scenario))
        final = f"{r.final_step}" + (" (unfinished)" if not r.finished
                                     else " (stopped)" if r.stopped else "")
        table.add_row(*name, _seconds(r.death_to_first_step_seconds),
                      _seconds(r.detection_seconds), _seconds(r.after_detection_seconds, 2),
                      _seconds(r.ready_seconds), _seconds(r.replacement_seconds),
                      _number(r.steps_lost), _number(r.samples_dropped), _number(r.restarts),
                      final, "-" if r.load is None else f"{r.load:.1f}",
                      end_section=many and index == len(results) - 1)
    return table


def _seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
