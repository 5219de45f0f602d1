"""One rank of a job: a Ray actor that owns one accelerator and holds a training session.

The controller creates one per rank inside the job's placement group, then drives it:

    place = worker.devices()                            # every rank: node, GPU ids, interface
    worker.set_up_devices(setup)                        # plan_devices(places)[rank]
    host, port = worker0.rendezvous_address()          # rank 0 only
    worker.join(host=host, port=port, backend="gloo", timeout_seconds=60)   # every rank
    plan = worker0.run_plan(options, lineage=None)      # rank 0 reads the checkpoint location
    worker.build(options, plan) -> Restored             # every rank: memory check, session
    worker.run_steps(1) -> [StepStats]                  # every rank, in step
    worker.checkpoint() -> Saved                        # every rank (collective)
    worker.health() -> WorkerHealth                     # any time, answered between steps too
    worker.flight_recorder() -> WorkerDump              # any time: a hung step's evidence

The session (:class:`~ringray.train.session.TrainingSession`) is the one ``run_training``
drives under torchrun; here the controller calls it one step at a time. Nothing here decides
anything: the worker never retries, never re-forms a group, never outlives its group. When
anything goes wrong the controller kills every worker of the job and starts new ones, so each
process group is formed exactly once per process.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from ringray.cluster.devices import (
    SOCKET_IFNAME_VARIABLES,
    DeviceSetup,
    WorkerPlace,
    interface_of,
    socket_variables,
)
from ringray.cluster.flight_recorder import WorkerDump, thread_stacks
from ringray.cluster.status import WorkerHealth
from ringray.data import PasskeyReport
from ringray.harness.evaluate import EvalPlan, EvalProgress
from ringray.train import StepStats, TrainOptions
from ringray.train.checkpoint_runs import RunPlan
from ringray.train.host_memory import release_freed_memory
from ringray.train.memory_check import (
    WorkerMemoryRefused,
    WorkerShare,
    check_worker_memory,
    host_memory,
)
from ringray.train.replicas import ReplicaMembership, ReplicaSync
from ringray.train.session import Restored, Saved, TrainingSession, plan_session


class TrainWorker:
    """The actor class (the controller wraps it with ``ray.remote`` and its resources).

    It runs with ``max_concurrency=2`` so :meth:`health` and :meth:`flight_recorder` answer
    while a step runs (or hangs); every other method is called by the controller one at a
    time.

    ``environment``: variables for torch, set before anything forms a process group (the
    flight recorder's, :func:`~ringray.cluster.flight_recorder.recorder_environment`).
    """

    def __init__(self, *, rank: int, world_size: int,
                 environment: Mapping[str, str] | None = None) -> None:
        release_freed_memory()  # the process trains from here on (ringray.train.host_memory)
        self._recorder_variables = tuple(environment or ())
        os.environ.update(environment or {})
        dump_file = (environment or {}).get("TORCH_FR_DUMP_TEMP_FILE")
        if dump_file is not None:  # torch writes NCCL's own dump there, but makes no directory
            Path(dump_file).parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.world_size = world_size
        self.session: TrainingSession | None = None
        self._busy_since: float | None = None
        self._cuda_device: int | None = None  # set by set_up_devices on a GPU worker

    # ----------------------------------------------------------------- probe
    def health(self) -> WorkerHealth:
        busy = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return WorkerHealth(
            rank=self.rank,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            step=self.session.step_count if self.session is not None else 0,
            busy_seconds=busy,
        )

    # ----------------------------------------------------------------- devices
    def devices(self) -> WorkerPlace:
        """Where this worker runs: its node, the GPUs Ray gave it, the interface holding the
        node's address."""
        return WorkerPlace(
            node_id=ray.get_runtime_context().get_node_id(),
            gpu_ids=tuple(str(i) for i in ray.get_runtime_context().get_accelerator_ids()
                          .get("GPU", [])),
            interface=interface_of(ray.util.get_node_ip_address(), _interface_addresses()),
        )

    def set_up_devices(self, setup: DeviceSetup) -> None:
        """See every GPU of the job on this node and use this worker's own; the collective
        interfaces the user has not chosen. Before anything touches CUDA or forms a group."""
        os.environ.update(socket_variables(setup, os.environ))
        if setup.visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = setup.visible_devices
            self._cuda_device = setup.local_rank

    def environment(self) -> dict[str, str | int | None]:
        """The device and flight recorder settings this worker runs with (for tests and
        ``ringray status``)."""
        names = ("CUDA_VISIBLE_DEVICES", *SOCKET_IFNAME_VARIABLES, *self._recorder_variables)
        return {**{name: os.environ.get(name) for name in names},
                "cuda_device": self._cuda_device}

    # ----------------------------------------------------------------- evidence
    def flight_recorder(self) -> WorkerDump:
        """What this process can say of a hung call (:mod:`ringray.cluster.flight_recorder`):
        torch's flight recorder, its record of the recent collectives, pickled as torch dumps
        it on a timeout (NCCL's own recorder on a GPU worker; ``None`` before the process
        group exists), and every other thread's Python stack. Answered on the actor's second
        thread while a step hangs: the stuck one waits with the GIL released."""
        recorder = None
        if dist.is_initialized():
            c10d = torch._C._distributed_c10d
            nccl_dump = getattr(c10d, "_dump_nccl_trace", None)
            dump = (nccl_dump if dist.get_backend() == "nccl" and nccl_dump is not None
                    else c10d._dump_fr_trace)
            recorder = dump(True, True, False)  # collectives, their call stacks, all of them
        stacks, stuck_at = thread_stacks()
        return WorkerDump(recorder=recorder, stacks=stacks, stuck_at=stuck_at)

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
        within it instead of the 30-minute default (the controller kills it sooner). On a GPU
        worker (NCCL) the group is bound to the worker's device, so its communicator is made
        here and every subgroup is split from it
        (:func:`~ringray.attention.groups.init_kwargs`).
        """
        from ringray.attention.groups import init_kwargs

        device = (torch.device("cuda", self._cuda_device) if self._cuda_device is not None
                  else None)
        with self._busy():
            dist.init_process_group(
                backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                world_size=self.world_size, timeout=timedelta(seconds=timeout_seconds),
                **init_kwargs(backend, device),
            )

    # ----------------------------------------------------------------- training
    def run_plan(self, options: TrainOptions, *, lineage: str | None) -> RunPlan:
        """The run's lineage and restore candidates, newest first, as this node sees the
        checkpoint location (:func:`~ringray.train.session.plan_session`)."""
        return plan_session(options, lineage=lineage)

    def build(self, options: TrainOptions, run: RunPlan, *,
              replica: ReplicaMembership | None = None) -> Restored:
        """Open this rank's training session (collective) and restore the newest usable
        checkpoint of ``run``, falling back past corrupt ones (each refusal one line).
        ``replica``: this rank's replica group (``parallel.dp_replicate``), whose rank of
        the same number it averages with and heals from (:mod:`ringray.train.replicas`).

        First every rank checks its memory (:meth:`check_memory`); on CPU (gloo) the ranks
        then wait for each other, so none allocates while a peer on its node still reads
        the node's available memory."""
        with self._busy():
            self.check_memory(options)
            if options.train.memory_check and dist.is_initialized() \
                    and dist.get_backend() == "gloo":
                dist.barrier()
            replicas = ReplicaSync(replica) if replica is not None else None
            self.session = TrainingSession(options, run, replicas=replicas)
            return self.session.restore()

    def check_memory(self, options: TrainOptions) -> None:
        """Raise :class:`~ringray.train.memory_check.WorkerMemoryRefused` (a ``ValueError``:
        the controller fails the job, no retry) when this worker's planned peak exceeds its
        share of its node (:mod:`ringray.train.memory_check`); nothing when
        ``train.memory_check`` is off. Touches no collective."""
        if not options.train.memory_check:
            return
        parallel = options.parallel
        refusal = check_worker_memory(options, dp=parallel.dp, cp=parallel.cp,
                                      on_gpu=self._cuda_device is not None,
                                      share=self._memory_share())
        if refusal is not None:
            raise WorkerMemoryRefused(refusal)

    def _memory_share(self) -> WorkerShare:
        """What this worker may use: its GPU's memory, or its node's available memory (or
        RINGRAY_NODE_MEMORY_BYTES) shared by the job's workers on the node."""
        node = ray.get_runtime_context().get_node_id()
        if self._cuda_device is not None:
            props = torch.cuda.get_device_properties(self._cuda_device)
            return WorkerShare(node=f"{props.name}'s memory on node {node[:8]}",
                               node_bytes=props.total_memory)
        where, node_bytes = host_memory(f"node {node[:8]}")
        return WorkerShare(node=where, node_bytes=node_bytes,
                           workers=self._workers_on_node(node))

    def _workers_on_node(self, node: str) -> int:
        """This job's workers on ``node``: the bundles Ray put there of this worker's
        placement group and, with replica groups, of the other groups' (every worker of the
        group, when it runs outside one)."""
        group = ray.util.get_current_placement_group()
        if group is None:
            return self.world_size
        own = ray.util.placement_group_table(group)
        return max(1, job_bundles_on_node(ray.util.placement_group_table(), own.get("name", ""),
                                          own.get("bundles_to_node_id", {}), node))

    def state_digest(self) -> str:
        """A digest of this rank's training state (equal across replica groups in step)."""
        session = self._opened()
        with self._busy():
            return session.state_digest()

    def take_replica_place(self, replica: ReplicaMembership) -> None:
        """This rank's standby group, built ahead, takes a lost group's place: it reads that
        group's slice and joins the quorums (it heals at its first step)."""
        session = self._opened()
        with self._busy():
            session.take_replica_place(replica)

    def fall_behind(self) -> None:
        """This rank's replica group heals from a live peer at its next step."""
        session = self._opened()
        with self._busy():
            session.fall_behind()

    def close(self) -> None:
        """End the session's servers (a replica group's torchft manager) before the actor is
        killed; nothing when no session was opened."""
        if self.session is not None:
            self.session.close()

    def run_steps(self, count: int) -> list[StepStats]:
        """Run ``count`` optimizer steps (every rank in step) and return their statistics."""
        session = self._opened()
        with self._busy():
            return [session.step() for _ in range(count)]

    def checkpoint(self) -> Saved:
        """Write and commit a checkpoint of the current step (collective)."""
        session = self._opened()
        with self._busy():
            return session.checkpoint()

    def evaluate_passkey(self) -> PasskeyReport | None:
        """The job's passkey evaluation (collective); ``None`` when the job asks for none."""
        session = self._opened()
        with self._busy():
            return session.evaluate()

    def evaluate_tasks(self, *, step: int, timeout_seconds: float) -> dict[str, str] | None:
        """The job's ``eval.tasks`` on checkpoint ``step``, every worker of the group one
        ring (collective); rank 0 returns the files written by name, the others ``None``."""
        from ringray.harness.job import evaluate_job_tasks

        session = self._opened()
        with self._busy():
            return evaluate_job_tasks(session.options, step=step, timeout_s=timeout_seconds)

    def evaluate_plan(self, plan: EvalPlan, *, timeout_seconds: float) -> dict[str, str] | None:
        """``ringray eval --address``: ``plan`` over every worker of the group as one ring,
        no training session (collective); rank 0 returns the files written by name."""
        from ringray.harness.job import evaluate_plan_on_group

        with self._busy():
            return evaluate_plan_on_group(plan, timeout_s=timeout_seconds)

    def task_progress(self) -> EvalProgress | None:
        """What rank 0's evaluation has done so far (answered while it runs)."""
        from ringray.harness.evaluate import progress_now

        return progress_now()

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """Mark a call in progress, for :meth:`health`; on a GPU worker, make its device
        current (actor calls run on threads, and the current device is per thread)."""
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def _opened(self) -> TrainingSession:
        if self.session is None:
            raise RuntimeError(f"rank {self.rank}: build() must run before training calls")
        return self.session


_REPLICA_GROUP_NAME = re.compile(r"^(?P<job>.+)-replica(?:\d+|-standby)-\d+$")


def job_bundles_on_node(table: dict, own_name: str, own_bundles: dict, node: str) -> int:
    """Bundles on ``node`` of the placement group named ``own_name`` and, when that is a
    replica group's (``ringray-<job>-replica<i>-<n>``, or the standby's
    ``ringray-<job>-replica-standby-<n>``: :mod:`.replica_groups`), of the job's other live
    replica groups' in ``table`` (``placement_group_table()``). A group still being
    made when this looks is not counted."""
    count = sum(1 for where in own_bundles.values() if where == node)
    match = _REPLICA_GROUP_NAME.match(own_name)
    if match is None:
        return count
    for entry in table.values():
        other = _REPLICA_GROUP_NAME.match(entry.get("name", ""))
        if (other is None or other["job"] != match["job"] or entry.get("name") == own_name
                or entry.get("state") == "REMOVED"):
            continue
        count += sum(1 for where in entry.get("bundles_to_node_id", {}).values()
                     if where == node)
    return count


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _interface_addresses() -> dict[str, list[str]]:
    """Each network interface's IPv4 address (Linux; interfaces without one are left out)."""
    addresses = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            addresses[name] = [socket.inet_ntoa(packed[20:24])]
    return addresses
