"""Replica groups on Ray (``parallel.dp_replicate`` R > 1): R copies of the job's dp × cp
mesh, each its own set of worker actors and its own ``torch.distributed`` world, averaging
their gradients through torchft (:mod:`ringray.train.replicas`), behind the one
:class:`~ringray.cluster.machine.WorkerGroup` the job's state machine drives.

    workers = ReplicatedWorkerGroup(job, record, should_stop=stop.is_set)
    plan = workers.plan(dp_choices, avoid=frozenset())      # R x dp rings, placed together
    workers.start(plan)                                     # the Lighthouse, then R groups
    restored = workers.build(options, workers.run_plan(lineage=None))
    stats = workers.step(move_now=decide)                   # a step the replicas committed

**What the machine sees.** One worker group: a step returns once the replica groups have
committed it, with the statistics of the lowest-index group that did (every participant
holds the same sums). The machine records each committed step once, so ``steps.jsonl`` never
holds a step twice, and a step no group committed (a peer died inside it) is run again
here, not recorded.

**A replica group fails** (its node dies, a rank is killed, it hangs past
``cluster.step_timeout_seconds``): it alone is torn down and recorded; the others' next step
commits without it (torchft's quorum leaves it out once its heartbeats stop,
``cluster.replica_heartbeat_seconds``), its slices of the batch dropped for the steps it
misses. A replacement is placed on the live nodes outside the survivors' slots, in a
``cluster.failure_domain`` none of them uses where such free slots exist (else anywhere free,
with a warning), in its own placement group, *in the background* while the survivors
train; it starts with no checkpoint and at its first step heals from a live peer (weights,
optimizer state, loader position, RNG, step), then trains with them. Replacements count against
``cluster.max_failures``. Only when no replica group is left alive does a failure reach the
machine, which then recovers as without replicas: every worker restarted, the last
checkpoint restored (two groups of two dying together take this path).

**The Lighthouse** (torchft's quorum server) is an actor on the head node, started anew
before the groups at every start (the machine's restarts included) and kept while a lost
group is replaced; if it dies, the groups' quorum calls fail, and the machine's recovery
starts a new one. Every group's torchft managers exist from its build, so the first quorum
waits for every group.

**Checkpoints and the passkey evaluation** are taken by one replica group, the lowest index
among those that trained the current step, while the others wait: the state is the same in
each. Placement: the R × dp rings come from one plan, which spreads rings over
``cluster.failure_domain`` where the nodes have one; replica group r gets rings r × dp to
(r + 1) × dp - 1. Fewer domains than groups is a warning, not an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace

import ray

from ringray.cluster.errors import JobError, StopRequested, WorkerGroupFailure
from ringray.cluster.job_options import JobOptions
from ringray.cluster.nodes import HEAD_NODE_RESOURCE, schedulable_nodes
from ringray.cluster.placement import (
    NodeSnapshot,
    PlacementError,
    PlacementPlan,
    RankPlacement,
    plan_placement,
)
from ringray.cluster.policy import Drain, Failure, FailureKind
from ringray.cluster.record import JobRecord
from ringray.cluster.worker_group import (
    CLOSE_SECONDS,
    RayWorkerGroup,
    plan_rings,
    request_full_size,
    withdraw_full_size,
)
from ringray.data import PasskeyReport
from ringray.train import StepStats, TrainOptions
from ringray.train.checkpoint_runs import RunPlan
from ringray.train.replicas import ReplicaMembership
from ringray.train.session import Restored, Saved

UNCOMMITTED_ATTEMPTS = 5
"""Steps in a row that no replica group commits before the job is treated as failed."""
SETTLE_SECONDS = 2.0
"""How long a round (and a checkpoint) waits for a call sent late to return with the others."""
REPLACE_RETRY_SECONDS = 5.0
"""A replacement that could not start (no room, a failed start) is tried again this much later."""
TEARDOWN_WAIT_SECONDS = 30.0
"""How long a teardown waits for the replacements and the standby still starting."""


class Lighthouse:
    """torchft's Lighthouse in an actor (``ray.remote`` wraps it, pinned to the head node)."""

    def __init__(self, *, min_replicas: int, join_timeout_ms: int,
                 heartbeat_timeout_ms: int) -> None:
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                                       join_timeout_ms=join_timeout_ms,
                                       heartbeat_timeout_ms=heartbeat_timeout_ms)
        port = self.server.address().rsplit(":", 1)[1]
        self._address = f"http://{ray.util.get_node_ip_address()}:{port}"

    def address(self) -> str:
        """Where the groups reach it (this node's address, which every node can route to)."""
        return self._address


def split_plan(plan: PlacementPlan, count: int) -> list[PlacementPlan]:
    """The plan of ``count`` × dp rings as ``count`` plans of dp rings each, ranks numbered
    from 0 in each (group r takes rings r × dp to (r + 1) × dp - 1)."""
    if plan.dp % count:
        raise ValueError(f"parallel.dp_replicate: {count} does not divide the plan's "
                         f"{plan.dp} rings")
    dp = plan.dp // count
    plans = []
    for index in range(count):
        rings = plan.rings[index * dp:(index + 1) * dp]
        order = [rank for ring in rings for rank in ring.ranks]
        new = {old: new for new, old in enumerate(order)}
        slots: dict[str, int] = {}
        ranks = []
        for new_rank, old in enumerate(order):
            node = plan.ranks[old].node_id
            ranks.append(RankPlacement(rank=new_rank, node_id=node, slot=slots.get(node, 0)))
            slots[node] = slots.get(node, 0) + 1
        plans.append(PlacementPlan(dp=dp, cp=plan.cp, ranks=tuple(ranks), rings=tuple(
            replace(ring, ring=i, ranks=tuple(new[r] for r in ring.ranks))
            for i, ring in enumerate(rings))))
    return plans


def replacement_plan(nodes: list[NodeSnapshot], used: dict[str, int], *, cp: int, dp: int,
                     failure_domain: str | None, ulysses: int = 1
                     ) -> tuple[PlacementPlan, str | None]:
    """Where a lost group's replacement goes: ``dp`` rings of ``cp`` on the slots of ``nodes``
    that the live groups (``used``: slots by node id) leave free. With ``failure_domain``, on
    nodes of a domain no live group uses where those slots suffice, so that one domain's loss
    cannot take the replacement with a survivor; otherwise on any free slots, and the second
    value is a warning naming the domains shared. Raises PlacementError when nothing fits."""
    free = [replace(node, slots=node.slots - used.get(node.node_id, 0)) for node in nodes]
    free = [node for node in free if node.slots > 0]

    def place(candidates: list[NodeSnapshot]) -> PlacementPlan:
        return plan_placement(candidates, cp=cp, dp_options=(dp,),
                              failure_domain=failure_domain, ulysses=ulysses)

    if not failure_domain:
        return place(free), None
    domain_of = {node.node_id: node.labels.get(failure_domain) for node in nodes}
    live = {domain_of.get(node_id) for node_id in used} - {None}
    apart = [node for node in free if domain_of[node.node_id] not in live]
    if live and apart:
        try:
            return place(apart), None
        except PlacementError:
            pass
    plan = place(free)
    shared = sorted(live & {domain_of[r.node_id] for r in plan.ranks} - {None})
    warning = None
    if shared:
        warning = (f"warning: the replacement shares {failure_domain!r} "
                   f"{', '.join(map(str, shared))} with a live replica group: no free slots "
                   f"for {dp} x {cp} ranks outside it")
    return plan, warning


def _with_heals(stats: StepStats, same_step: list[StepStats]) -> StepStats:
    """The step the job records (one group's statistics: every participant holds the same
    sums), marked healed when any group that committed it healed at its start (a joining
    group is not the one whose statistics are kept, so its heal was never reported)."""
    heals = [s.heal_seconds for s in same_step if s.healed]
    if not heals or stats.healed:
        return stats
    return replace(stats, healed=True, heal_seconds=max(heals))


class _GroupRecord:
    """What one replica group's worker group records: its events, marked with the group, and
    its workers, merged with the other groups' into the job's list. A standby's (``index``
    None until it replaces a group) are kept out of the job's list until then."""

    def __init__(self, parent: ReplicatedWorkerGroup, index: int | None) -> None:
        self.parent, self.index = parent, index
        self.healths: tuple = ()

    def event(self, message: str, *, exc: BaseException | None = None) -> None:
        who = "the standby group" if self.index is None else f"replica group {self.index}"
        self.parent.record.event(f"{who}: {message}", exc=exc)

    def workers(self, healths: tuple) -> None:
        self.healths = healths
        if self.index is not None:
            self.parent.group_workers(self.index, healths)

    def become(self, index: int) -> None:
        """The standby takes group ``index``'s place: its workers join the job's list."""
        self.index = index
        self.parent.group_workers(index, self.healths)


class ReplicatedWorkerGroup:
    """The job's replica groups, seen by the state machine as one worker group."""

    def __init__(self, job: JobOptions, record: JobRecord, *,
                 should_stop: Callable[[], bool]) -> None:
        self.job, self.record, self.should_stop = job, record, should_stop
        self.count = job.train.parallel.dp_replicate
        self.cluster = job.cluster
        self.members: dict[int, RayWorkerGroup] = {}  # live groups, built
        self.pending: dict[int, Future] = {}  # replacements starting, by group index
        self.stepped: dict[int, int] = {}  # each live group's last committed step
        self.inflight: dict[int, Future] = {}  # each live group's step call
        self.joining: set[int] = set()  # replacements that have not committed a step yet
        self.lighthouse = None
        self.lighthouse_address: str | None = None
        self.options: TrainOptions | None = None  # one group's options (its own dp)
        self.run: RunPlan | None = None
        self.replacements = 0
        self._generation = 0  # teardowns so far: a replacement of an older one is dropped
        self._starting: dict[int, RayWorkerGroup] = {}  # replacements coming up, by index
        self._retry_at: dict[int, float] = {}  # replacements to try again, when
        self.job_step = 0  # the newest step a call of step() returned
        self._failure: Failure | None = None
        self._healths: dict[int, tuple] = {}
        self._incarnation = 0
        self._standby: Future | None = None  # cluster.replica_standby: a group made ahead
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2 * self.count + 2,
                                        thread_name_prefix="ringray-replicas")

    def _group(self, index: int | None) -> RayWorkerGroup:
        """A new worker group for replica group ``index`` (None: the standby, which is named
        as a replica group so that the workers' memory check counts its bundles)."""
        self._incarnation += 1
        return RayWorkerGroup(self.job, _GroupRecord(self, index), should_stop=self.should_stop,
                              name=f"ringray-{self.job.name}-replica"
                                   f"{'-standby' if index is None else index}-{self._incarnation}")

    def group_workers(self, index: int, healths: tuple) -> None:
        with self._lock:
            self._healths[index] = healths
            merged = tuple(h for i in sorted(self._healths) for h in self._healths[i])
        self.record.workers(merged)

    # ----------------------------------------------------------------- placement
    def plan(self, dp_choices: tuple[int, ...], *, avoid: frozenset[str]) -> PlacementPlan:
        """``dp_replicate`` × dp rings in one plan (dp: the largest of ``dp_choices`` that
        fits), so that rings spread over the failure domains together."""
        try:
            plan = plan_rings(self.job, tuple(dp * self.count for dp in dp_choices),
                              avoid=avoid)
        except PlacementError as exc:
            dp, cp = min(dp_choices), self.job.cp
            total = self._live_slots(avoid)
            raise PlacementError(
                f"placement: parallel.dp_replicate {self.count} replica groups × dp {dp} × cp "
                f"{cp} = {self.count * dp * cp} worker slots needed on live nodes; they have "
                f"{total} ({exc})") from None
        domain = self.cluster.failure_domain
        if domain:
            labels = {n.node_id: n.labels.get(domain) for n in schedulable_nodes(
                worker_resources=self.job.worker_resources, avoid=set(avoid))}
            groups = [{labels.get(r.node_id) for r in part.ranks}
                      for part in split_plan(plan, self.count)]
            if len(set().union(*groups)) < self.count:
                self.record.event(
                    f"warning: parallel.dp_replicate: {self.count} replica groups over "
                    f"{len(set().union(*groups))} {domain!r} failure domain(s); one domain's "
                    f"loss can take more than one group (label the nodes' {domain!r})")
        return plan

    def _live_slots(self, avoid: frozenset[str]) -> int:
        """Worker slots on the live nodes (those in ``avoid`` left out), for messages."""
        return sum(node.slots for node in schedulable_nodes(
            worker_resources=self.job.worker_resources, avoid=set(avoid)))

    def feasible_dp(self, dp_choices: tuple[int, ...], *, avoid: frozenset[str]) -> int:
        try:
            return self.plan(dp_choices, avoid=avoid).dp // self.count
        except PlacementError:
            return 0

    def ask_for_full_size(self) -> None:
        request_full_size(self.job)

    def withdraw_request(self) -> None:
        withdraw_full_size(self.job)

    # ----------------------------------------------------------------- starting
    def start(self, plan: PlacementPlan) -> None:
        self._start_lighthouse()
        groups = {index: self._group(index) for index in range(self.count)}
        starts = {index: self._pool.submit(group.start, part)
                  for (index, group), part in zip(groups.items(), split_plan(plan, self.count),
                                                  strict=True)}
        self.members = groups  # torn down together if any fails
        for future in starts.values():
            future.result()  # WorkerGroupFailure / JobError / StopRequested: to the machine

    def _start_lighthouse(self) -> None:
        """A new Lighthouse for every start of the groups, the machine's restarts included:
        one that remembers a quorum of the groups before the restart would give the first
        group to ask a quorum of its own at once (torchft forms a quorum as soon as every
        member of the previous one has asked), and the others would wait out their quorum
        timeout. A new one knows only the groups that heartbeat to it, and each group's
        managers exist from its build (:meth:`ReplicaSync.attach
        <ringray.train.replicas.ReplicaSync.attach>`), so the first quorum waits for them."""
        self._kill_lighthouse()
        heartbeat_ms = round(self.cluster.replica_heartbeat_seconds * 1000)
        self.lighthouse = ray.remote(Lighthouse).options(
            num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001}, max_restarts=0,
            name=f"ringray-{self.job.name}-lighthouse").remote(
            min_replicas=1, join_timeout_ms=heartbeat_ms, heartbeat_timeout_ms=heartbeat_ms)
        self.lighthouse_address = ray.get(self.lighthouse.address.remote(),
                                          timeout=self.cluster.startup_timeout_seconds)
        self.record.event(f"torchft Lighthouse at {self.lighthouse_address} for "
                          f"{self.count} replica groups")

    def run_plan(self, *, lineage: str | None) -> RunPlan:
        return self.members[0].run_plan(lineage=lineage)

    def _replica(self, index: int, group: RayWorkerGroup) -> ReplicaMembership:
        timeout = max(1.0, self.cluster.step_timeout_seconds / 2)
        return ReplicaMembership(index=index, count=self.count, lighthouse=self.lighthouse_address,
                            store=group.address, timeout_seconds=timeout,
                            collective_timeout_seconds=self.cluster
                            .replica_collective_timeout_seconds,
                            quorum_timeout_seconds=self.cluster.step_timeout_seconds)

    def build(self, options: TrainOptions, run: RunPlan) -> Restored:
        """Every group opens its sessions and restores the same checkpoint (each reads it).
        ``options`` are one group's (``parallel.dp`` its own rings)."""
        self.options, self.run = options, run
        builds = {index: self._pool.submit(group.build, self.options, run,
                                           replica=self._replica(index, group))
                  for index, group in self.members.items()}
        restored = {index: future.result() for index, future in builds.items()}
        self.stepped = {index: r.step for index, r in restored.items()}
        self.job_step = restored[0].step
        self._prepare_standby()
        return restored[0]

    # ----------------------------------------------------------------- losing and replacing
    def _lose(self, index: int, failure: Failure) -> None:
        """Group ``index`` failed: tear it down alone, start its replacement in the
        background (the others keep training)."""
        group = self.members.pop(index)
        self.stepped.pop(index, None)
        self.inflight.pop(index, None)
        self.joining.discard(index)
        with self._lock:
            self._healths.pop(index, None)
        self.record.replica_lost(index, reason=failure.kind.value, detail=failure.detail,
                                 left=len(self.members))
        group.teardown()
        self.replacements += 1
        if self.replacements > self.cluster.max_failures:
            raise JobError(f"replica groups lost {self.replacements} times, more than "
                           f"cluster.max_failures: {self.cluster.max_failures}; last: replica "
                           f"group {index}, {failure.detail}")
        if self.members:
            self.pending[index] = self._pool.submit(self._replace, index)

    def _replace(self, index: int) -> RayWorkerGroup:
        """A new group ``index`` on the live nodes, built with no checkpoint: it heals from
        a live peer at its first step. A teardown meanwhile kills it where it is."""
        started = time.monotonic()
        with self._lock:
            generation = self._generation
        group = self._join_standby(index, generation)
        ahead = group is not None
        if group is None:
            group = self._group(index)
            self._register_start(index, group, generation)
        try:
            if not ahead:
                group.start(self._plan_replacement(index))
            group.build(self.options, RunPlan(lineage=self.run.lineage, restore=()),
                        replica=self._replica(index, group))
        except BaseException:
            group.teardown()  # (again, if a teardown found it starting: that is harmless)
            raise
        finally:
            with self._lock:
                self._starting.pop(index, None)
        if self._generation != generation:
            group.teardown()
            raise JobError(f"replica group {index}'s replacement came up after a teardown")
        how = " by the standby group" if ahead else ""
        self.record.event(f"replica group {index} replaced{how} in "
                          f"{time.monotonic() - started:.1f} s; it heals from a live peer at "
                          f"its first step")
        return group

    # ----------------------------------------------------------------- the standby
    def _prepare_standby(self) -> None:
        """Unless ``cluster.replica_standby`` is false: start one group's workers ahead (in the
        background), on free slots apart from the live groups, up to the point of joining a
        process group, so that a replacement only joins, builds and heals."""
        wanted = self.cluster.replica_standby is not False  # unset: whenever there is room
        if wanted and self._standby is None and self.options is not None:
            self._standby = self._pool.submit(self._start_standby, self._generation)

    def _register_start(self, key: int, group: RayWorkerGroup, generation: int) -> None:
        """Mark ``group`` as starting (a teardown kills it where it is), unless a teardown
        came since ``generation``: then it is never started."""
        with self._lock:
            if self._generation != generation:
                raise JobError("the replica groups were torn down before this start")
            self._starting[key] = group

    def _start_standby(self, generation: int) -> RayWorkerGroup | None:
        group = self._group(None)
        self._register_start(-1, group, generation)
        try:
            group.prepare(self._plan_replacement(None))
        except PlacementError:
            group.teardown()
            self.record.event(self._no_room_for_standby())
            return None
        except BaseException:
            group.teardown()  # (again, if a teardown found it starting: that is harmless)
            raise
        finally:
            with self._lock:
                self._starting.pop(-1, None)
        if self._generation != generation:  # abandoned: a teardown came while it started
            group.teardown()
            return None
        nodes = ", ".join(sorted(group.plan_.slots_by_node()))
        self.record.event(f"a standby group is up on {nodes}, ready to replace a lost group")
        return group

    def _no_room_for_standby(self) -> str:
        """Why there is no standby group, with the arithmetic of the slots."""
        need = self.options.parallel.dp * self.job.cp
        live = len(self.members)
        total = self._live_slots(frozenset())
        slots = "slot" if need == 1 else "slots"
        return (f"no standby group: it needs {need} free worker {slots} (dp "
                f"{self.options.parallel.dp} × cp {self.job.cp}); the live nodes have {total}, "
                f"and the {live} live replica group(s) hold {live * need}, so a lost group's "
                f"replacement will start its processes when it is needed (add a node with "
                f"{need} {slots}, or set cluster.replica_standby: false to say none is wanted)")

    def _join_standby(self, index: int, generation: int) -> RayWorkerGroup | None:
        """The standby as group ``index``, its process group formed; None (and the standby
        torn down) if there is none, or it did not come up, or it cannot join. The next
        standby is started once the replacement is adopted (:meth:`_adopt`)."""
        group = self._take_standby(index)
        if group is None:
            return None
        try:
            self._register_start(index, group, generation)
        except JobError:
            group.teardown()
            raise
        try:
            group.record.become(index)
            group.join_group()
        except (WorkerGroupFailure, JobError) as exc:
            self.record.event(f"replica group {index}: the standby group could not join "
                              f"({exc}); starting a replacement")
            group.teardown()
            return None
        finally:
            with self._lock:
                self._starting.pop(index, None)
        return group

    def _standby_up(self) -> RayWorkerGroup | None:
        """The standby if it has come up (without waiting for one still starting)."""
        future = self._standby
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def _take_standby(self, index: int) -> RayWorkerGroup | None:
        """The standby, if it came up and its nodes are all live (else it is torn down)."""
        future, self._standby = self._standby, None
        if future is None:
            return None
        try:
            group = future.result()
        except Exception as exc:
            self.record.event(f"replica group {index}: the standby group did not come up "
                              f"({exc}); starting a replacement")
            return None
        if group is None:
            return None
        live = {node.node_id for node in schedulable_nodes(
            worker_resources=self.job.worker_resources, avoid=set())}
        if not set(group.plan_.slots_by_node()) <= live:
            group.teardown()
            return None
        return group

    def _plan_replacement(self, index: int | None) -> PlacementPlan:
        """Group ``index``'s rings on the live nodes' slots that the live groups leave free,
        in a failure domain of their own where possible (:func:`replacement_plan`)."""
        used: dict[str, int] = {}
        standby = self._standby_up()  # its slots are taken too
        holders = list(self.members.values()) + ([standby] if standby else [])
        for member in holders:
            if member.plan_ is not None:
                for node, n in member.plan_.slots_by_node().items():
                    used[node] = used.get(node, 0) + n
        nodes = schedulable_nodes(worker_resources=self.job.worker_resources, avoid=set())
        plan, warning = replacement_plan(nodes, used, cp=self.job.cp,
                                         dp=self.options.parallel.dp,
                                         failure_domain=self.cluster.failure_domain,
                                         ulysses=self.job.ulysses)
        if warning:
            who = "the standby group" if index is None else f"replica group {index}"
            self.record.event(f"{who}: {warning}")
        return plan

    def _adopt(self) -> None:
        """Replacements that have come up join the next step; failed ones are tried again."""
        now = time.monotonic()
        for index, when in list(self._retry_at.items()):
            if now >= when:
                del self._retry_at[index]
                self.pending[index] = self._pool.submit(self._replace, index)
        for index, future in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[index]
            try:
                self.members[index] = future.result()
                self.joining.add(index)
                self._prepare_standby()  # for the next loss
            except StopRequested:
                continue  # the machine stops the job
            except (WorkerGroupFailure, JobError, PlacementError) as exc:
                self.record.event(f"replica group {index}'s replacement did not start: {exc}; "
                                  f"trying again in {REPLACE_RETRY_SECONDS:.0f} s (the others "
                                  f"train on)")
                self._retry_at[index] = now + REPLACE_RETRY_SECONDS

    # ----------------------------------------------------------------- training
    def step(self, *, move_now: Callable[[Drain], str | None]) -> StepStats:
        """One step the replica groups committed (a step none committed is run again).

        The calls of the groups already training go out together and are waited for. A
        group that joins (a replacement) waits inside its first call for a quorum with
        theirs, heals there and trains that step with them, so its call is never waited on.
        Whenever a call returns a step the job already has (a joining group's, or one left
        from an earlier round), that group's next call goes out at once: the Lighthouse
        waits for every member of the last quorum, so the others' next step would otherwise
        wait for it until the quorum timeout."""
        self._failure = None
        for _ in range(UNCOMMITTED_ATTEMPTS):
            self._adopt()
            for index, group in self.members.items():
                if index not in self.inflight:
                    self.inflight[index] = self._pool.submit(group.step, move_now=move_now)
            waiting = {index for index in self.members if index not in self.joining}
            committed: list[tuple[int, StepStats]] = []
            resent: set[int] = set()
            while waiting & set(self.inflight):
                watched = {self.inflight[i]: i for i in self.inflight
                           if i in waiting or i in self.joining}
                done, _ = wait(watched, return_when=FIRST_COMPLETED)
                for call in done:
                    index = watched[call]
                    joined = index in self.joining
                    waiting.discard(index)
                    stats = self._outcome(index)
                    if stats is not None and stats.committed and stats.step > self.job_step:
                        committed.append((index, stats))
                    elif stats is not None and index in self.members and (
                            joined or stats.committed):
                        # A joining group's first call, or a call left from an earlier round
                        # (a step the job already has): the group's next call goes out now,
                        # for the quorum the others wait in (the Lighthouse waits for every
                        # member of the last quorum). It is waited for in a later round.
                        self.inflight[index] = self._pool.submit(self.members[index].step,
                                                                 move_now=move_now)
                        resent.add(index)
            # A call sent again above is most often in the quorum the others just finished:
            # it returns with them, and taking it now keeps the groups in step.
            committed += self._settle(resent)
            if committed:
                stats = max(committed, key=lambda c: (c[1].step, -c[0]))[1]
                self.job_step = stats.step
                return _with_heals(stats, [s for _, s in committed if s.step == stats.step])
        raise WorkerGroupFailure(self._failure or Failure(
            kind=FailureKind.HANG, detail=f"no replica group committed a step in "
                                          f"{UNCOMMITTED_ATTEMPTS} attempts"))

    def _settle(self, indices: set[int]) -> list[tuple[int, StepStats]]:
        """Take the calls of ``indices`` that return within :data:`SETTLE_SECONDS`; the rest
        stay in flight (waiting for a later quorum). Returns the new committed steps."""
        calls = {self.inflight[i]: i for i in indices if i in self.inflight}
        if not calls:
            return []
        done, _ = wait(calls, timeout=SETTLE_SECONDS)
        fresh = []
        for call in done:
            index = calls[call]
            stats = self._outcome(index)
            if stats is not None and stats.committed and stats.step > self.job_step:
                fresh.append((index, stats))
        return fresh

    def _outcome(self, index: int) -> StepStats | None:
        """Take group ``index``'s finished step call: a failure loses the group (or, for the
        last one, goes to the machine), a heal is recorded, a commit marks its step."""
        call = self.inflight.pop(index)
        try:
            stats = call.result()
        except WorkerGroupFailure as exc:
            self._failure = exc.failure
            holding = set(self.members) - self.joining - {index}
            if not holding:  # the last group with the job's state: the checkpoint path
                if len(self.members) > 1:
                    joining = ", ".join(map(str, sorted(set(self.members) - {index})))
                    self.record.event(f"replica group {index} was the last group holding the "
                                      f"job's state (group {joining} had not healed yet): the "
                                      f"job restarts from its checkpoint")
                raise
            if not self._lighthouse_answers():
                self.record.event("the torchft Lighthouse is gone: no group can form a "
                                  "quorum, so the job restarts from its checkpoint")
                raise
            self._lose(index, exc.failure)
            return None
        if stats.healed:
            self.record.replica_healed(index, step=stats.step, seconds=stats.heal_seconds)
        if stats.committed:
            if stats.step > self.job_step:  # caught up (a joining group alone counts from 0)
                self.joining.discard(index)
            self.stepped[index] = stats.step
        return stats

    def _current(self) -> list[tuple[int, RayWorkerGroup]]:
        """Live groups at the newest committed step, lowest index first."""
        newest = max(self.stepped.values(), default=0)
        return [(i, self.members[i]) for i in sorted(self.members)
                if self.stepped.get(i) == newest]

    def _one_group(self, call: Callable[[RayWorkerGroup], object]) -> object:
        """``call`` on the lowest current group; on its failure, the next one."""
        failure = None
        for index, group in self._current():
            try:
                return call(group)
            except WorkerGroupFailure as exc:
                failure = exc
                if len(self.members) == 1:
                    raise
                self._lose(index, exc.failure)
        raise failure or WorkerGroupFailure(Failure(kind=FailureKind.HANG,
                                                    detail="no replica group is live"))

    def checkpoint(self) -> Saved:
        """One group saves; then every group at the current step compares its state with
        it, rank for rank (weights, optimizer state, loader, RNG, step). A group that holds
        another state heals from a live peer at the next step (:meth:`_compare_states`)."""
        self._settle(set(self.inflight))  # a group's call still returning this step
        saved = self._one_group(lambda group: group.checkpoint())
        self._compare_states(saved.checkpoint.step)
        return saved

    def _compare_states(self, step: int) -> None:
        """The current groups' state digests against the first one's (the group that saved).
        A group that differs falls behind (:meth:`ReplicaSync.fall_behind
        <ringray.train.replicas.ReplicaSync.fall_behind>`): at the next step torchft heals it
        from a live peer, so gradients of different weights are never averaged again. A group
        that fails meanwhile is lost alone, as in a step."""
        digests: dict[int, list[str]] = {}
        for index, group in self._current():
            try:
                digests[index] = group.state_digests()
            except WorkerGroupFailure as exc:
                if len(self.members) == 1:
                    raise
                self._lose(index, exc.failure)
        if len(digests) < 2:
            return
        first, *others = digests
        names = ", ".join(map(str, digests))
        differ = [index for index in others if digests[index] != digests[first]]
        if not differ:
            self.record.event(f"replica groups {names} hold identical state at step {step} "
                              f"(digest {digests[first][0][:12]})")
            return
        self.record.event(f"warning: replica groups {names} differ at step {step}: group(s) "
                          f"{', '.join(map(str, differ))} hold another state than group "
                          f"{first}, which saved it; they heal from a live peer at the next "
                          f"step")
        for index in differ:
            try:
                self.members[index].fall_behind()
            except WorkerGroupFailure as exc:
                self._lose(index, exc.failure)

    def evaluate(self) -> PasskeyReport | None:
        return self._one_group(lambda group: group.evaluate())

    def poll(self) -> None:
        self._adopt()
        for index, group in list(self.members.items()):
            try:
                group.poll()
            except WorkerGroupFailure as exc:
                if len(self.members) == 1:
                    raise
                self._lose(index, exc.failure)

    def take_drain(self) -> Drain | None:
        for group in self.members.values():
            drain = group.take_drain()
            if drain is not None:
                return drain
        return None

    # ----------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Every group, the starts in flight and the standby, and the workers' list; the
        Lighthouse stays for the job's next start (:meth:`close` ends it).

        The live groups' workers are first asked to shut their torchft managers down (at
        most :data:`~ringray.cluster.worker_group.CLOSE_SECONDS`). A start in flight has its
        group torn down where it is and is then waited for, at most
        :data:`TEARDOWN_WAIT_SECONDS`, so that whatever it made meanwhile goes too (its
        thread tears its group down again on its way out); one still running after that is
        recorded, never left silently."""
        with self._lock:
            self._generation += 1
            starting, self._starting = self._starting, {}
        starts = [*self.pending.values(), *([self._standby] if self._standby else [])]
        closing = [ref for group in self.members.values() for ref in group.ask_to_close()]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_SECONDS)
        for group in [*starting.values(), *self.members.values()]:
            group.teardown()
        _, running = wait(starts, timeout=TEARDOWN_WAIT_SECONDS) if starts else ((), ())
        for future in starts:
            if future.done() and future.exception() is None and future.result() is not None:
                future.result().teardown()
        if running:
            self.record.event(f"warning: {len(running)} replica group start(s) still running "
                              f"{TEARDOWN_WAIT_SECONDS:.0f} s after the teardown; their groups "
                              f"are torn down when they return")
        for call in self.inflight.values():
            call.cancel()
        self.pending.clear()
        self._retry_at.clear()
        self._standby = None
        self.members, self.stepped, self.inflight, self.joining = {}, {}, {}, set()
        with self._lock:
            self._healths.clear()

    def close(self) -> None:
        """The job has ended: the groups and the Lighthouse go."""
        self.teardown()
        self._kill_lighthouse()
        self._pool.shutdown(wait=False)

    def _lighthouse_answers(self) -> bool:
        try:
            ray.get(self.lighthouse.address.remote(), timeout=10)
            return True
        except Exception:
            return False

    def _kill_lighthouse(self) -> None:
        if self.lighthouse is not None:
            try:
                ray.kill(self.lighthouse, no_restart=True)
            except Exception as exc:
                self.record.event(f"the torchft Lighthouse could not be killed: {exc}",
                                  exc=exc)
            self.lighthouse, self.lighthouse_address = None, None
