"""One rank of a job: a Ray actor that owns one accelerator and wraps a :class:`Trainer`.

The controller creates one per rank inside the job's placement group, then drives it:

    host, port = worker0.rendezvous_address()          # rank 0 only
    worker.join(host=host, port=port, backend="gloo", timeout_seconds=60)   # every rank
    worker.build(options, checkpoint)                   # every rank: Trainer (+ restore)
    worker.run_steps(1) -> [StepStats]                  # every rank, in step
    worker.checkpoint() -> CheckpointRef                # every rank (collective)
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

from ringray.cluster.status import WorkerHealth
from ringray.data import PasskeyReport
from ringray.train import CheckpointRef, CheckpointStore, StepStats, Trainer, TrainOptions
from ringray.train.loop import evaluate_passkey_retrieval


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
    def latest_checkpoint(self, location: str) -> CheckpointRef | None:
        """The newest complete checkpoint at ``location``, as this node sees it."""
        return CheckpointStore(location).latest()

    def build(self, options: TrainOptions, checkpoint: CheckpointRef | None) -> int:
        """Create the trainer (collective) and restore ``checkpoint``; returns the step."""
        self._busy_since = time.monotonic()
        try:
            self.trainer = Trainer(options)
            self.store = CheckpointStore(options.checkpoint_location)
            if checkpoint is not None:
                self.trainer.load_checkpoint(self.store, checkpoint)
            return self.trainer.step_count
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

    def checkpoint(self) -> CheckpointRef:
        """Write and commit a checkpoint of the current step (collective)."""
        trainer = self._built()
        self._busy_since = time.monotonic()
        try:
            return trainer.save_checkpoint(self.store)
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
