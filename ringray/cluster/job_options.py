"""What the controller needs to know about a job, as frozen dataclasses (no Ray imported).

:class:`ClusterOptions` is the job spec's ``cluster`` section, declared here once (the spec
derives its YAML section from it). :class:`JobOptions` is what a controller runs: the job's
name, its training options, the cluster section and the metrics endpoint, with the values the
controller needs resolved (the elastic floor, each worker's Ray resources)::

    job = JobOptions(name="quick", train=train_options, cluster=ClusterOptions(dp_min=1))
    job.cp, job.ulysses, job.dp_max, job.dp_min, job.worker_resources
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Annotated, Literal

from annotated_types import Ge, Gt, MinLen

from ringray.metrics import MetricsOptions
from ringray.train import TrainOptions

# Every collective's timeout, in step timeouts (cluster.step_timeout_seconds): well after the
# controller's step timeout and its flight recorder dumps (cluster.hang_dump_seconds), so a
# hang is seen (and reported, with every live rank's dump) by the controller, not as a
# survivor's collective error; under torchrun, a rank whose peer died fails by itself.
COLLECTIVE_TIMEOUT_FACTOR = 2
# A hung step's flight recorder dumps (cluster.hang_dump_seconds unset): this share of the
# step timeout, at most HANG_DUMP_MAX_SECONDS.
HANG_DUMP_SHARE = 0.25
HANG_DUMP_MAX_SECONDS = 30.0
# Ray's built-in resources that a worker may not ask for by name; others are custom resources.
_RAY_RESERVED = ("memory", "object_store_memory")


@dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    """How `ringray train` runs the job on Ray (the job spec's ``cluster`` section)."""

    accelerator: Literal["cpu", "gpu"] = "cpu"
    """What each worker owns: one GPU (NCCL rings) or one CPU slot (gloo)."""
    worker_resources: Mapping[str, float] | None = None
    """Ray resources of one worker, e.g. {GPU: 1, CPU: 8}; null: {GPU: 1} for accelerator gpu,
    {CPU: 1} for cpu. With gpu, GPU must be 1 (one NCCL rank per device); with cpu, no GPU. A
    custom resource pins workers to the nodes that offer it."""
    dp_min: Annotated[int, Ge(1)] | None = None
    """Elastic floor: the job runs at the largest dp from dp_min to parallel.dp that fits the
    live nodes and divides train.global_batch, instead of waiting; null: parallel.dp (a fixed
    size)."""
    max_failures: Annotated[int, Ge(0)] = 3
    """Faults recovered before the job fails (preemptions not counted)."""
    step_timeout_seconds: Annotated[float, Gt(0)] = 300.0
    """A step (or checkpoint) that takes longer is a hang: recover. Every collective's
    timeout is twice this (under torchrun too), so a rank whose peer died fails by itself."""
    hang_dump_seconds: Annotated[float, Gt(0)] | None = None
    """Once a step or checkpoint passes step_timeout_seconds, how long the controller waits
    for every worker's flight recorder (torch's record of its recent collectives: which one
    hung, on which rank) before it kills them; the dumps go to RUN/flight-recorder/. null: a
    quarter of step_timeout_seconds, at most 30. Less than step_timeout_seconds, so the
    workers are killed before their collective timeout (twice step_timeout_seconds), when
    NCCL's watchdog would abort them itself."""
    startup_timeout_seconds: Annotated[float, Gt(0)] = 120.0
    """Time for workers, process groups and trainers to come up."""
    capacity_wait_seconds: Annotated[float, Ge(0)] = 600.0
    """How long to wait for room for dp_min rings before the job fails (an embedded local Ray
    does not wait: nothing can join it)."""
    grow_after_seconds: Annotated[float, Ge(0)] = 10.0
    """New capacity must stay live this long before the job grows into it (at the next
    checkpoint boundary), so a flickering node never makes it flap."""
    failure_domain: Annotated[str, MinLen(1)] | None = "zone"
    """Node label whose values DP replicas are spread over; null: none."""
    request_resources: bool = True
    """Ask the Ray autoscaler for the full size while running smaller."""
    poll_seconds: Annotated[float, Gt(0)] = 0.5
    """How often the controller checks node liveness and drain notices between steps."""
    intra_node_gbps: Annotated[float, Gt(0)] | None = None
    """Link speed inside a node (Gb/s) for the placement's costs."""
    inter_node_gbps: Annotated[float, Gt(0)] | None = None
    """Link speed between nodes (Gb/s) for the placement's costs."""
    replica_heartbeat_seconds: Annotated[float, Gt(0)] = 2.0
    """With parallel.dp_replicate > 1: a replica group silent this long is left out of the
    next quorum (the survivors' next step commits without it), and the first quorum waits
    this long for every group."""
    replica_collective_timeout_seconds: Annotated[float, Gt(0)] = 30.0
    """With parallel.dp_replicate > 1: how long a cross-replica gradient average waits for a
    group that does not take part; past it the step is not committed and is taken again
    without that group. A group cut off by a partition costs the others this long once (a
    dead one costs nothing: its connections close). It must cover how much later one group
    reaches the average than another (their steps start together). A heal's transfer has
    the longer step timeout."""
    replica_heal_transport: Literal["http", "process_group"] = "http"
    """With parallel.dp_replicate > 1: how a group behind (a replacement, a restart) receives a
    live peer's state: http (torchft's checkpoint server on each rank) or process_group (over
    the replica process group the averages use: gloo on CPU, NCCL on GPUs)."""
    replica_standby: bool | None = None
    """With parallel.dp_replicate > 1: keep one replica group built ahead on free slots apart
    from the live groups (processes up, devices set, process group formed, trainer built with
    fresh weights; no torchft manager), so that a lost group's replacement only takes its
    place and heals from a live peer instead of starting processes and building. The standby
    holds its slots (and its trainer's memory) while it waits. Unset (the default): a
    standby whenever the live nodes have the free slots for one, and one line saying so when
    they have not; false: never (a lost group's replacement starts its processes when it is
    needed); true: as unset, and refused without replica groups."""

    def replica_settings(self) -> dict:
        """A replica group's timeouts and heal transport, as
        :class:`~ringray.train.replicas.ReplicaMembership` takes them (on Ray and under
        torchrun alike): a ``should_commit`` or a heal waits half a step timeout, a quorum a
        whole one."""
        return dict(timeout_seconds=max(1.0, self.step_timeout_seconds / 2),
                    collective_timeout_seconds=self.replica_collective_timeout_seconds,
                    quorum_timeout_seconds=self.step_timeout_seconds,
                    heal_transport=self.replica_heal_transport)

    @property
    def collective_timeout_seconds(self) -> float:
        """The process group's timeout: :data:`COLLECTIVE_TIMEOUT_FACTOR` step timeouts (a
        collective inside a step is never the step's only work)."""
        return COLLECTIVE_TIMEOUT_FACTOR * self.step_timeout_seconds

    @property
    def dump_grace_seconds(self) -> float:
        """How long a hung step's workers have to hand over their flight recorders
        (``hang_dump_seconds``, or :data:`HANG_DUMP_SHARE` of the step timeout, at most
        :data:`HANG_DUMP_MAX_SECONDS`)."""
        if self.hang_dump_seconds is not None:
            return self.hang_dump_seconds
        return min(HANG_DUMP_MAX_SECONDS, HANG_DUMP_SHARE * self.step_timeout_seconds)

    @property
    def kill_deadline_seconds(self) -> float:
        """When, into a hung step (or checkpoint), the controller kills its workers: the step
        timeout, then the dump grace (then a health probe of at most 2 s for each rank that
        does not answer, to name them). Before :attr:`collective_timeout_seconds` (checked
        at construction), so the workers are alive to answer the controller's dump request
        and NCCL's watchdog does not abort them first."""
        return self.step_timeout_seconds + self.dump_grace_seconds

    def __post_init__(self) -> None:
        self._check_timeouts()
        self._check_worker_resources()

    def _check_timeouts(self) -> None:
        """The kill (step timeout + dump grace) must come before the collective timeout."""
        if self.kill_deadline_seconds >= self.collective_timeout_seconds:
            step, grace = self.step_timeout_seconds, self.dump_grace_seconds
            raise ValueError(
                f"cluster.hang_dump_seconds: {grace:g} would kill a hung step's workers "
                f"{step + grace:g} s into it, not before their collective timeout "
                f"({self.collective_timeout_seconds:g} s = {COLLECTIVE_TIMEOUT_FACTOR} x "
                f"cluster.step_timeout_seconds), when NCCL's watchdog aborts them itself; "
                f"use less than {self.collective_timeout_seconds - step:g}")

    def _check_worker_resources(self) -> None:
        resources = self.worker_resources
        if resources is None:
            return
        if not resources:
            raise ValueError("worker_resources: {} asks for nothing; give at least one "
                             "resource, e.g. {CPU: 1}")
        for name, amount in resources.items():
            if name.upper() in ("CPU", "GPU") and name not in ("CPU", "GPU"):
                raise ValueError(f"worker_resources.{name}: Ray's resource names are "
                                 f"case-sensitive; write {name.upper()}")
            if name in _RAY_RESERVED:
                raise ValueError(f"worker_resources.{name}: not a worker resource ringray can "
                                 f"ask Ray for; use CPU, GPU or a custom resource")
            if amount <= 0:
                raise ValueError(f"worker_resources.{name}: {amount:g} is not positive; give "
                                 f"an amount > 0, or leave {name} out")
        gpus = resources.get("GPU")
        if self.accelerator == "gpu" and gpus != 1:
            got = "no GPU" if gpus is None else f"GPU: {gpus:g}"
            raise ValueError(
                f"worker_resources: {got} with accelerator gpu; each worker drives exactly one "
                f"GPU (one NCCL rank per device), so give GPU: 1"
            )
        if self.accelerator == "cpu" and gpus is not None:
            raise ValueError(
                f"worker_resources: GPU: {gpus:g} with accelerator cpu (gloo rings that never "
                f"use it); set cluster.accelerator: gpu, or leave GPU out"
            )

    @property
    def process_group_backend(self) -> str:
        return "nccl" if self.accelerator == "gpu" else "gloo"


def check_elastic_floor(cluster: ClusterOptions, train: TrainOptions) -> None:
    """``cluster.dp_min`` must be a size the job can run at: at most ``parallel.dp``, and a
    divisor of the global batch; ``cluster.replica_standby: true`` needs replica groups.
    Raises ``ValueError`` naming the field."""
    replicas = train.parallel.dp_replicate
    if cluster.replica_standby and replicas < 2:
        raise ValueError(
            f"cluster.replica_standby: true keeps a replica group's workers ready to replace a "
            f"lost group, but parallel.dp_replicate is {replicas} (no replica groups); set "
            f"parallel.dp_replicate >= 2 or leave replica_standby unset")
    dp_min, dp = cluster.dp_min, train.parallel.dp
    if dp_min is None or dp is None:
        return
    if dp_min > dp:
        raise ValueError(
            f"cluster.dp_min: {dp_min} is larger than parallel.dp={dp} (the size the job asks "
            f"for); use a value from 1 to {dp}"
        )
    if replicas > 1 and dp_min != dp:
        raise ValueError(
            f"cluster.dp_min: {dp_min} with parallel.dp_replicate: {replicas}; replica groups "
            f"keep their size (a lost group is replaced, not shrunk): leave dp_min unset or "
            f"equal to parallel.dp={dp}")
    batch = train.train.global_batch
    if batch % dp_min:
        raise ValueError(
            f"cluster.dp_min: train.global_batch={batch} does not split over dp_min={dp_min} "
            f"replicas; use a divisor of it (sizes between dp_min and parallel.dp that do not "
            f"divide it are skipped)"
        )


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """One job as a controller runs it. The mesh must be explicit (``parallel.dp`` and
    ``parallel.cp`` set): there is no world size to infer it from."""

    name: str
    train: TrainOptions
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    run_spec: str | None = None
    """The job file as run (``RUN/job.yaml``'s text, :func:`ringray.spec.run_spec.
    run_spec_text`): the controller writes it into the run directory once the job has
    started, so the directory has one writer wherever `ringray train` runs (it may run on
    another host than the controller). None: no job.yaml (a job started from Python)."""

    def __post_init__(self) -> None:
        parallel = self.train.parallel
        for name in ("dp", "cp"):
            if getattr(parallel, name) is None:
                raise ValueError(f"parallel.{name}: required by `ringray train` (there is no "
                                 f"world size to infer it from); give a number")
        check_elastic_floor(self.cluster, self.train)

    @property
    def cp(self) -> int:
        return self.train.parallel.cp

    @property
    def ulysses(self) -> int:
        """Ranks per Ulysses group (``parallel.ulysses``): placement keeps each group of
        this many consecutive ranks on one node."""
        return self.train.parallel.ulysses

    @property
    def replicas(self) -> int:
        """Replica groups (``parallel.dp_replicate``), each of dp × cp workers."""
        return self.train.parallel.dp_replicate

    @property
    def dp_max(self) -> int:
        """The data-parallel size the job asks for."""
        return self.train.parallel.dp

    @property
    def standby_workers(self) -> int:
        """Workers of the standby replica group (``cluster.replica_standby``), 0 without."""
        wanted = self.replicas > 1 and self.cluster.replica_standby is not False
        return self.dp_max * self.cp if wanted else 0

    @property
    def workers_wanted(self) -> int:
        """Workers of the job at its full size: every replica group's dp × cp, and the
        standby group's (an embedded Ray is sized for this many)."""
        return self.replicas * self.dp_max * self.cp + self.standby_workers

    @property
    def dp_min(self) -> int:
        """The smallest size it may shrink to instead of waiting."""
        return self.cluster.dp_min or self.dp_max

    @property
    def worker_resources(self) -> dict[str, float]:
        """Ray resources of one worker (the spec's, or one GPU / one CPU by accelerator)."""
        if self.cluster.worker_resources is not None:
            return dict(self.cluster.worker_resources)
        return {"GPU": 1.0} if self.cluster.accelerator == "gpu" else {"CPU": 1.0}

    def actor_resources(self) -> dict:
        """``ray.remote`` options for one worker: its CPUs, GPUs and custom resources."""
        resources = self.worker_resources
        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": resources.get("CPU", 0),
            "num_gpus": resources.get("GPU", 0),
            "resources": custom,
        }


def job_differences(running: JobOptions, wanted: JobOptions) -> list[str]:
    """The job-file fields whose values differ between two jobs of the same name, as
    ``field: running → wanted`` (dotted as in the job file: ``train.steps``,
    ``cluster.max_failures``); the job file's text itself (``run_spec``) is not compared,
    so a comment or a reordering is no difference."""
    found: list[str] = []

    def walk(a: object, b: object, path: str) -> None:
        if is_dataclass(a) and is_dataclass(b) and type(a) is type(b):
            for item in fields(a):
                walk(getattr(a, item.name), getattr(b, item.name),
                     f"{path}.{item.name}" if path else item.name)
        elif a != b:
            found.append(f"{path}: {a!r} → {b!r}")

    for name in ("cluster", "metrics"):
        walk(getattr(running, name), getattr(wanted, name), name)
    walk(running.train, wanted.train, "")  # its sections are the job file's top level
    return found
