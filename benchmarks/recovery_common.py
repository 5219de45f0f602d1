"""Recovery from a node's death: ringray's service against Ray Train v2, side by side.

The shared half of ``benchmarks/recovery.py`` (the command-line script): the options, the
result record, the local multi-node cluster, the job both systems run, and the table.
ringray's side is in ``recovery_ringray.py``, Ray Train's in ``recovery_ray_train.py``.

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

Environment: Ray must have been imported with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
``RAY_AUTH_MODE=disabled`` (and ``RAY_TRAIN_V2_ENABLED=1`` for Ray Train v2) already set;
``benchmarks/recovery.py`` sets them before anything imports Ray. These helper modules never
read or set environment variables themselves.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray.cluster_utils import Cluster
from rich.table import Table

from ringray.cluster.driver import NAMESPACE
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
        parallel=ParallelOptions(dp=1, cp=2, layout="zigzag", attention_backend="sdpa"),
        train=TrainingOptions(
            seq_len=options.seq_len,
            global_batch=2,
            steps=options.steps,
            precision="fp32",
            optimizer=OptimizerOptions(lr=1e-2, warmup_steps=1),
            peak_tflops_per_device=1.0,  # a fixed peak: no matmul measurement at each start
        ),
        checkpoint=CheckpointOptions(interval=options.checkpoint_interval, keep=3),
        run_dir=run_dir,
    )


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
