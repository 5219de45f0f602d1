"""One rank of a job: a Ray actor that owns one accelerator and wraps a :class:`Trainer`.

The controller creates one per rank inside the job's placement group, then drives it:

    host, port = worker0.rendezvous_address()          # rank 0 only
    worker.join(host=host, port=port, backend="gloo", timeout_seconds=60)   # every rank
    plan = worker0.run_plan(location=..., lineage=None, resume=True, move_aside=False)
    worker.build(options, plan)                         # every rank: Trainer (+ restore)
    worker.run_steps(1) -> [StepStats]                  # every rank, in step
    worker.checkpoint() -> (CheckpointRef, warnings)    # every rank (collective)
    worker.health() -> WorkerHealth                     # any time, answered between steps too

Nothing here decides anything: the worker never retries, never re-forms a group, never
outlives its ring. When anything goes wrong the controller kills every worker of the job and
starts new ones, so each process group is formed exactly once per process.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import ray
import torch.distributed as dist

from ringray.cluster.machine import Built
from ringray.cluster.status import WorkerHealth
from ringray.data import PasskeyReport
from ringray.train import CheckpointRef, CheckpointStore, StepStats, Trainer, TrainOptions
from ringray.train.checkpoint import RunPlan, plan_run
from ringray.train.loop import evaluate_passkey_retrieval, restore_newest


class TrainWorker:
    """The actor class (the controller wraps it with ``ray.remote`` and its resources).

    It runs with ``max_concurrency=2`` so :meth:`health` answers while a step runs; every
    other method is called by the controller one at a time.
    """

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.trainer: Trainer | None = None
        self.store: CheckpointStore | None = None
        self._busy_since: float | None = None

    # ----------------------------------------------------------------- probe
    def health(self) -> WorkerHealth:
        busy = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return WorkerHealth(
            rank=self.rank,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            step=self.trainer.step_count if self.trainer is not None else 0,
            busy_seconds=busy,
        )

    # ----------------------------------------------------------------- process groups
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free TCP port for the group's store (rank 0's job)."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return host, sock.getsockname()[1]

    def join(self, *, host: str, port: int, backend: str, timeout_seconds: float) -> None:
        """Join the job's default process group (blocks until every rank has joined).

        ``timeout_seconds`` bounds every later collective too: a rank whose peer died fails
        within it instead of the 30-minute default (the controller kills it sooner).
        """
        self._busy_since = time.monotonic()
        try:
            dist.init_process_group(
                backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                world_size=self.world_size, timeout=timedelta(seconds=timeout_seconds),
            )
        finally:
            self._busy_since = None

    # ----------------------------------------------------------------- training
    def run_plan(self, *, location: str, lineage: str | None, resume: bool,
                 move_aside: bool) -> RunPlan:
        """The run's lineage and restore candidates, newest first, as this node sees the
        checkpoint location: at the first start (``lineage`` None) per ``resume`` and
        ``move_aside`` (:func:`~ringray.train.checkpoint.plan_run`); later, the committed
        checkpoints of ``lineage``."""
        store = CheckpointStore(location)
        if lineage is None:
            return plan_run(store, resume=resume, move_aside=move_aside)
        return RunPlan(lineage=lineage, restore=tuple(store.of_lineage(lineage)))

    def build(self, options: TrainOptions, run: RunPlan) -> Built:
        """Create the trainer (collective) and restore the newest usable checkpoint of ``run``,
        falling back past corrupt ones (each refusal is reported, one line)."""
        self._busy_since = time.monotonic()
        try:
            self.trainer = Trainer(options)
            self.store = CheckpointStore(options.checkpoint_location, lineage=run.lineage)
            refused: list[str] = []
            restored = restore_newest(self.trainer, self.store, run.restore,
                                      on_refused=refused.append)
            return Built(step=self.trainer.step_count, restored=restored,
                         refused=tuple(refused))
        finally:
            self._busy_since = None

    def run_steps(self, count: int) -> list[StepStats]:
        """Run ``count`` optimizer steps (every rank in step) and return their statistics."""
        trainer = self._built()
        self._busy_since = time.monotonic()
        try:
            return [trainer.step() for _ in range(count)]
        finally:
            self._busy_since = None

    def checkpoint(self) -> tuple[CheckpointRef, tuple[str, ...]]:
        """Write and commit a checkpoint of the current step (collective); the ref and what
        went wrong without failing it (pruning)."""
        trainer = self._built()
        self._busy_since = time.monotonic()
        try:
            ref = trainer.save_checkpoint(self.store)
            warnings, self.store.warnings = tuple(self.store.warnings), []
            return ref, warnings
        finally:
            self._busy_since = None

    def evaluate_passkey(self) -> PasskeyReport | None:
        """The job's passkey evaluation (collective); ``None`` when the job asks for none."""
        trainer = self._built()
        self._busy_since = time.monotonic()
        try:
            return evaluate_passkey_retrieval(trainer)
        finally:
            self._busy_since = None

    def _built(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(f"rank {self.rank}: build() must run before training calls")
        return self.trainer
