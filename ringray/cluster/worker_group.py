"""The job's workers on Ray: what :class:`~ringray.cluster.machine.WorkerGroup` asks for, done.

    workers = RayWorkerGroup(job, record, should_stop=stop_event.is_set)
    plan = workers.plan(dp_choices, avoid=frozenset())
    workers.start(plan); run = workers.run_plan(lineage=None)
    restored = workers.build(options, run)       # every worker opens its training session
    stats = workers.step(move_now=decide)
    workers.teardown()

Workers are created in a placement group whose bundles are pinned to the planned nodes (Ray's
``ray.io/node-id`` label; with ``parallel.ulysses`` each Ulysses group's ranks on one node),
checked against the plan once they report where they run, and
joined into one process group through rank 0's TCP rendezvous. Every wait goes through
:class:`~ringray.cluster.watch.WorkerWatch`, which turns what goes wrong into
:class:`~ringray.cluster.errors.WorkerGroupFailure` (or :class:`JobError` when a retry cannot help).
A step or checkpoint that hangs is reported only after every worker has been asked for its
flight recorder (:mod:`ringray.cluster.flight_recorder`): the workers start with the
recorder's settings, and the machine kills them after the dumps, before their collective
timeout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ringray.cluster.devices import plan_devices
from ringray.cluster.errors import CallTimeout, JobError, WorkerGroupFailure
from ringray.cluster.flight_recorder import recorder_directory, recorder_environment
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.nodes import NODE_ID_LABEL, schedulable_nodes
from ringray.cluster.placement import (
    LinkBandwidths,
    PlacementError,
    PlacementPlan,
    plan_placement,
    verify_placement,
)
from ringray.cluster.policy import Drain, Failure, FailureKind
from ringray.cluster.record import JobRecord
from ringray.cluster.resource_requests import resource_requests
from ringray.cluster.watch import WorkerWatch
from ringray.cluster.worker import TrainWorker
from ringray.data import PasskeyReport
from ringray.train import StepStats, TrainOptions
from ringray.train.checkpoint_runs import RunPlan
from ringray.train.replicas import ReplicaMembership
from ringray.train.session import Restored, Saved

# A teardown gives the workers this long to shut their servers down before it kills them.
CLOSE_SECONDS = 2.0
# The passkey evaluation runs this many cells per step timeout.
_EVAL_CELLS_PER_TIMEOUT = 8


def plan_rings(job: JobOptions, dp_choices: tuple[int, ...], *,
               avoid: frozenset[str]) -> PlacementPlan:
    """The placement of ``dp`` rings of ``job.cp`` workers on the live nodes (those in
    ``avoid`` left out), dp the largest of ``dp_choices`` that fits (raises
    ``PlacementError`` when none does): one group of workers, or every replica group's
    rings together."""
    cluster = job.cluster
    nodes = schedulable_nodes(worker_resources=job.worker_resources, avoid=set(avoid))
    bandwidths = LinkBandwidths(**{
        name: value for name, value in (
            ("intra_node_gbps", cluster.intra_node_gbps),
            ("inter_node_gbps", cluster.inter_node_gbps),
        ) if value is not None
    })
    return plan_placement(
        nodes, cp=job.cp, dp_options=dp_choices, failure_domain=cluster.failure_domain,
        bandwidths=bandwidths, kv_block_bytes=_kv_block_bytes(job), ulysses=job.ulysses,
    )


def _kv_block_bytes(job: JobOptions) -> int:
    """Bytes of the K/V block one rank passes per layer and ring step, at the target dp.
    With Ulysses a ring rank holds its member's chunk (``ulysses`` times the tokens) for
    1/ulysses of the kv heads, repeated first when ulysses exceeds them: the same bytes,
    times the repeat."""
    model, train = job.train.model, job.train.train
    element = 2 if job.cluster.accelerator == "gpu" else 4
    local_batch = max(1, train.global_batch // (job.dp_max * job.replicas))
    repeat = max(1, job.ulysses // model.n_kv_heads)
    return (2 * local_batch * (train.seq_len // job.cp) * model.n_kv_heads * repeat
            * model.head_dim * element)


def task_evaluation_timeout(cluster: ClusterOptions, samples: int) -> float:
    """How long an lm_eval task evaluation of ``samples`` samples in all may take (a job's
    ``eval.tasks``, or ``ringray eval --address``): generous, a step timeout a sample (the
    watch sees dead nodes sooner)."""
    return cluster.step_timeout_seconds * (1 + samples)


def request_full_size(job: JobOptions) -> None:
    """Ask the autoscaler for every worker the job wants at its full size (every replica
    group's and the standby's: ``JobOptions.workers_wanted``), when the job allows it."""
    if job.cluster.request_resources:
        full_size = [job.worker_resources] * job.workers_wanted
        ray.get(resource_requests().set.remote(job.name, full_size))


def withdraw_full_size(job: JobOptions) -> None:
    """The job has ended: its request goes; other jobs' requests stand."""
    if job.cluster.request_resources:
        ray.get(resource_requests().withdraw.remote(job.name))


class RayWorkerGroup:
    """The current workers of one job (none between a teardown and the next start)."""

    def __init__(self, job: JobOptions, record: JobRecord, *,
                 should_stop: Callable[[], bool], name: str | None = None) -> None:
        self.job = job
        self.name = name or f"ringray-{job.name}"  # its placement group's (unique) name
        self.record = record
        self.should_stop = should_stop
        self.cluster = job.cluster
        self.watch = WorkerWatch(poll_seconds=job.cluster.poll_seconds,
                               settle_seconds=job.cluster.startup_timeout_seconds,
                               log=record.event)
        self.workers: list = []
        self.pg = None
        self.plan_: PlacementPlan | None = None
        self.address: tuple[str, int] | None = None  # rank 0's store: (host, port)
        # Where the current workers' flight recorders go (one directory per start).
        self.recorder_dir = recorder_directory(job.train.run_dir, self.name)

    # ----------------------------------------------------------------- placement
    def plan(self, dp_choices: tuple[int, ...], *, avoid: frozenset[str]) -> PlacementPlan:
        return plan_rings(self.job, dp_choices, avoid=avoid)

    def feasible_dp(self, dp_choices: tuple[int, ...], *, avoid: frozenset[str]) -> int:
        try:
            return self.plan(dp_choices, avoid=avoid).dp
        except PlacementError:
            return 0

    def ask_for_full_size(self) -> None:
        request_full_size(self.job)

    def withdraw_request(self) -> None:
        withdraw_full_size(self.job)

    def close(self) -> None:
        """Nothing outlives this group's workers (:meth:`teardown` frees them)."""

    # ----------------------------------------------------------------- starting
    def start(self, plan: PlacementPlan) -> None:
        self.prepare(plan)
        self.join_group()

    def prepare(self, plan: PlacementPlan) -> None:
        """The first half of :meth:`start`: the placement group reserved, the workers up
        (processes started, torch imported), placed as planned and their devices set; no
        process group yet. A replica group's standby stops here (:mod:`.replica_groups`)."""
        timeout = self.cluster.startup_timeout_seconds
        try:
            self._create_workers(plan)
            healths = self.watch.wait([w.health.remote() for w in self.workers],
                                      timeout=timeout, should_stop=self.should_stop)
            try:
                verify_placement(plan, [h.node_id for h in healths])
            except PlacementError as exc:
                raise JobError(f"workers did not land where planned: {exc}") from None
            self.watch.track(self.workers, tuple(h.node_id for h in healths))
            self.record.workers(tuple(healths))
            self._set_up_devices()
        except CallTimeout as exc:
            raise WorkerGroupFailure(Failure(kind=FailureKind.STARTUP, detail=str(exc))) from None

    def join_group(self) -> None:
        """The second half of :meth:`start`: the workers form their process group."""
        timeout = self.cluster.startup_timeout_seconds
        try:
            host, port = self.watch.wait([self.workers[0].rendezvous_address.remote()],
                                         timeout=timeout, should_stop=self.should_stop)[0]
            self.address = (host, port)
            self.watch.wait(
                [w.join.remote(host=host, port=port,
                               backend=self.cluster.process_group_backend,
                               timeout_seconds=self.cluster.collective_timeout_seconds)
                 for w in self.workers],
                timeout=timeout, should_stop=self.should_stop,
            )
        except CallTimeout as exc:
            raise WorkerGroupFailure(Failure(kind=FailureKind.STARTUP, detail=str(exc))) from None

    def _set_up_devices(self) -> None:
        """Every worker's devices and interfaces, decided together (:mod:`.devices`)."""
        timeout = self.cluster.startup_timeout_seconds
        places = self.watch.wait([w.devices.remote() for w in self.workers], timeout=timeout,
                                 should_stop=self.should_stop)
        self.watch.wait([w.set_up_devices.remote(setup) for w, setup in
                         zip(self.workers, plan_devices(places), strict=True)],
                        timeout=timeout, should_stop=self.should_stop)

    def _create_workers(self, plan: PlacementPlan) -> None:
        self.plan_ = plan
        # From the moment their placement group is asked for, the planned nodes are watched.
        self.watch.track([], tuple(rank.node_id for rank in plan.ranks))
        bundles = [self.job.worker_resources for _ in plan.ranks]
        selectors = [{NODE_ID_LABEL: rank.node_id} for rank in plan.ranks]
        self.pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors,
                                  name=self.name)
        self.watch.wait([self.pg.ready()], timeout=self.cluster.startup_timeout_seconds,
                        what="the placement group to be reserved", should_stop=self.should_stop)
        actor = ray.remote(TrainWorker)
        resources = self.job.actor_resources()
        started = time.strftime("%Y%m%dT%H%M%S")
        self.recorder_dir = recorder_directory(self.job.train.run_dir, f"{self.name}-{started}")
        environment = recorder_environment(self.cluster.process_group_backend,
                                           directory=self.recorder_dir,
                                           dump_seconds=self.cluster.dump_grace_seconds)
        self.workers = [
            actor.options(
                max_concurrency=2,  # health() and flight_recorder() answer while a step runs
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank.rank,
                ),
                **resources,
            ).remote(rank=rank.rank, world_size=plan.world_size, environment=environment)
            for rank in plan.ranks
        ]
        self.watch.track(self.workers, self.watch.nodes)

    def run_plan(self, *, lineage: str | None) -> RunPlan:
        return self._startup_call([self.workers[0].run_plan.remote(
            self.job.train, lineage=lineage)])[0]

    def build(self, options: TrainOptions, run: RunPlan, *,
              replica: ReplicaMembership | None = None) -> Restored:
        """Every worker opens its training session; ``replica``: this group's place among
        the job's replica groups (:mod:`ringray.cluster.replica_groups`)."""
        return self._startup_call([w.build.remote(options, run, replica=replica)
                                   for w in self.workers])[0]

    def state_digests(self) -> list[str]:
        """Each rank's digest of its training state (weights, optimizer, loader, step)."""
        return self._startup_call([w.state_digest.remote() for w in self.workers])

    def take_replica_place(self, replica: ReplicaMembership) -> None:
        """A standby group, built ahead, takes a lost replica group's place (every rank)."""
        self._startup_call([w.take_replica_place.remote(replica) for w in self.workers])

    def fall_behind(self) -> None:
        """Every rank heals from its peer in a live replica group at the next step."""
        self._startup_call([w.fall_behind.remote() for w in self.workers])

    def ask_to_close(self) -> list:
        """Ask every worker to end its servers (a replica group's torchft managers) before
        :meth:`teardown` kills it; the calls' refs, for the caller to wait on with a bound (a
        dead worker's fails at once, a hung one's may never answer)."""
        return [w.close.remote() for w in self.workers]

    def _startup_call(self, refs: list) -> list:
        try:
            return self.watch.wait(refs, timeout=self.cluster.startup_timeout_seconds,
                                   should_stop=self.should_stop)
        except CallTimeout as exc:
            raise WorkerGroupFailure(Failure(kind=FailureKind.STARTUP, detail=str(exc))) from None

    # ----------------------------------------------------------------- training
    def step(self, *, move_now: Callable[[Drain], str | None]) -> StepStats:
        try:
            results = self.watch.wait([w.run_steps.remote(1) for w in self.workers],
                                      timeout=self.cluster.step_timeout_seconds,
                                      what="a step", move_now=move_now)
        except CallTimeout as exc:
            raise self._hung(exc, "a step") from None
        return results[0][-1]

    def checkpoint(self) -> Saved:
        try:
            return self.watch.wait([w.checkpoint.remote() for w in self.workers],
                                   timeout=self.cluster.step_timeout_seconds,
                                   what="a checkpoint")[0]
        except CallTimeout as exc:
            raise self._hung(exc, "a checkpoint") from None

    def _hung(self, exc: CallTimeout, what: str) -> WorkerGroupFailure:
        """``what`` passed the step timeout: the hang's failure, once every worker has been
        asked for its flight recorder (first, while the hang is freshest) and the silent ranks
        are known."""
        self.dump_flight_recorders(what)
        return WorkerGroupFailure(Failure(kind=FailureKind.HANG, detail=(
            f"{exc}; {self.watch.describe_silence()}")))

    def dump_flight_recorders(self, what: str) -> str | None:
        """Ask every worker for its flight recorder and wait for the answers at most
        ``cluster.hang_dump_seconds`` (each on the actor's second thread: the first is stuck
        in ``what``), then record them (:meth:`~ringray.cluster.record.JobRecord.
        flight_recorder`); returns the event's line. Nothing raises from here: the hang is
        reported either way."""
        grace = self.cluster.dump_grace_seconds
        try:
            refs = [w.flight_recorder.remote() for w in self.workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace)
            dumps = {}
            for rank, ref in enumerate(refs):
                if ref in ready:
                    try:
                        dumps[rank] = ray.get(ref)
                    except ray.exceptions.RayError:  # dead, or its dump failed: not answered
                        continue
            return self.record.flight_recorder(self.recorder_dir, dumps,
                                               ranks=len(self.workers),
                                               waited_seconds=grace, what=what)
        except Exception as exc:  # evidence is a bonus: never in the way of the recovery
            self.record.event(f"flight recorder: not collected ({type(exc).__name__}: {exc})",
                              exc=exc)
            return None

    def evaluate(self) -> PasskeyReport | None:
        passkey = self.job.train.eval
        cells = (len(passkey.passkey_lengths) * len(passkey.passkey_depths)
                 * passkey.passkey_samples)
        timeout = self.cluster.step_timeout_seconds * max(
            1, math.ceil(cells / _EVAL_CELLS_PER_TIMEOUT))
        try:
            return self.watch.wait([w.evaluate_passkey.remote() for w in self.workers],
                                   timeout=timeout, what="the passkey evaluation",
                                   should_stop=self.should_stop)[0]
        except CallTimeout as exc:
            raise WorkerGroupFailure(Failure(kind=FailureKind.HANG, detail=str(exc))) from None

    def evaluate_tasks(self, step: int) -> dict[str, str] | None:
        evaluation = self.job.train.eval
        if not evaluation.tasks:
            return None
        samples = len(evaluation.tasks) * len(evaluation.task_lengths) * evaluation.task_samples
        timeout = task_evaluation_timeout(self.cluster, samples)
        ring_timeout = self.cluster.collective_timeout_seconds
        try:
            return self.watch.wait(
                [w.evaluate_tasks.remote(step=step, timeout_seconds=ring_timeout)
                 for w in self.workers],
                timeout=timeout, what="the task evaluation", should_stop=self.should_stop)[0]
        except CallTimeout as exc:
            raise WorkerGroupFailure(Failure(kind=FailureKind.HANG, detail=str(exc))) from None

    def poll(self) -> None:
        """Between steps: dead nodes raise; a drain is noted for :meth:`take_drain` (the
        decision to move now or checkpoint first is the machine's)."""
        self.watch.check_nodes()
        self.watch.check_drains(lambda drain: None)

    def take_drain(self) -> Drain | None:
        drain, self.watch.drain = self.watch.drain, None
        return drain

    # ----------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Kill every worker and release the placement group; a worker that cannot be killed
        is recorded by rank, actor and node, with the error."""
        nodes = self.watch.nodes
        for rank, worker in enumerate(self.workers):
            try:
                ray.kill(worker, no_restart=True)
            except Exception as exc:
                node = nodes[rank][:8] if rank < len(nodes) else "unknown"
                self.record.event(f"rank {rank} (actor {worker._actor_id.hex()[:12]}, node "
                                  f"{node}) could not be killed: {exc}", exc=exc)
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception as exc:
                self.record.event(f"the placement group {self.name} could not be "
                                  f"removed: {exc}", exc=exc)
        self.watch.forget()
        self.workers, self.pg, self.address = [], None, None
