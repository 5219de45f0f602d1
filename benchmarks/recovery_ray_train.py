"""The Ray Train v2 baseline of ``benchmarks/recovery.py``: the same job under a
``TorchTrainer`` with ``FailureConfig(max_failures=…)`` and Ray Train's default health checks.

Its train loop (:func:`ray_train_loop`) builds the same :class:`~ringray.train.Trainer` as
ringray's workers, restores the newest complete checkpoint from a
:class:`~ringray.train.CheckpointStore`, steps, checkpoints and ``ray.train.report``s; rank 0
logs each step's wall time to a JSONL file, and a ``UserCallback`` on Ray Train's controller
logs when it saw the workers' failure. The figures are read back from that log.

This module imports without Ray Train installed (:func:`ray_train_missing` says whether it
can run). ``benchmarks/`` is not an importable package on Ray's workers, so this module and
``recovery_common`` are registered with Ray's cloudpickle to be pickled *by value*: the train
loop and the callback travel to Ray Train's workers and controller as code, not as a
reference to a module those processes could not import.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import recovery_common
from ray import cloudpickle
from recovery_common import (
    SLOT_RESOURCE,
    BenchNodes,
    Log,
    RecoveryBenchOptions,
    RecoveryResult,
    bench_train_options,
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
    steps, interval = options.train.steps, options.checkpoint.interval
    while trainer.step_count < steps:
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
    train = bench_train_options(options, str(work / "run"))
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"options": train, "events_path": str(events)},
        scaling_config=ScalingConfig(num_workers=2,
                                     resources_per_worker={"CPU": 1, SLOT_RESOURCE: 1}),
        run_config=RunConfig(name="recovery-bench", storage_path=str(work / "storage"),
                             failure_config=FailureConfig(max_failures=options.max_failures),
                             callbacks=[failure_clock(str(events))]),
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
