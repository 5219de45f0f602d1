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
``cluster.step_timeout_seconds``), in a step, a checkpoint, the state-digest comparison, a
poll or an evaluation: while another group holds the job's state it alone is torn down and
recorded; the others' next step commits without it (torchft's quorum leaves it out once its
heartbeats stop, ``cluster.replica_heartbeat_seconds``), its slices of the batch dropped for
the steps it misses. A replacement is placed on the live nodes outside the survivors' slots, in
a ``cluster.failure_domain`` none of them uses where such free slots exist (else anywhere free,
with a warning), in its own placement group, *in the background* while the survivors train;
it starts with no checkpoint and at its first step heals from a live peer (weights, optimizer
state, loader position, RNG, step), then trains with them. A replacement that cannot start
is tried again :data:`REPLACE_RETRY_SECONDS` later. Losses count against
``cluster.max_failures``. Only when no group holding the job's state is left does a failure
reach the machine, which then recovers as without replicas: every worker restarted, the last
checkpoint restored (two groups of two dying together take this path).

**The slots** (:mod:`ringray.cluster.replica_slots`). Each group's place is one state:
``Starting`` (its call in flight, the generation it started in), ``Joining`` (a replacement
built, not yet past the job's step), ``Live`` (at the step it last committed) or ``Lost``
(its replacement due at a retry time); besides them, the standby's state, the generation
(teardowns so far), the losses and the job's step. That state is read and changed on the
caller's thread only (the controller's machine thread), by pure transitions; the pool's
threads run the Ray calls (start, prepare, join, build, step) and hand back a value or an
exception through their futures, which the caller's thread applies as events. A teardown
starts a new generation: the starts in flight are cancelled where they have not begun, their
groups torn down where they are, and they are waited for (at most
:data:`TEARDOWN_WAIT_SECONDS`) so that what they made meanwhile is torn down too; one that
returns later, however late, is torn down, never adopted.

**The Lighthouse** (torchft's quorum server) is an actor on the head node, started anew
before the groups at every start (the machine's restarts included) and kept while a lost
group is replaced; if it dies, the groups' quorum calls fail, and the machine's recovery
starts a new one. Every group's torchft managers exist from its build, so the first quorum
waits for every group.

**Checkpoints and the passkey evaluation** are taken by one replica group, the lowest index
among those that trained the current step, while the others wait: the state is the same in
each (one that fails is lost alone, and the next takes its place). Placement: the R × dp
rings come from one plan, which spreads rings over ``cluster.failure_domain`` where the nodes
have one; replica group r gets rings r × dp to (r + 1) × dp - 1. Fewer domains than groups is
a warning, not an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import (
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    CancelledError,
    Future,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import replace
from functools import partial

import ray

from ringray.cluster.errors import JobError, WorkerGroupFailure
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
from ringray.cluster.replica_slots import (
    Action,
    AwaitStarts,
    CallSent,
    Cancel,
    Due,
    Escalate,
    Event,
    Formed,
    GiveUp,
    GroupFailed,
    JobStepped,
    Joining,
    Live,
    PrepareStandby,
    Record,
    RecordLost,
    Replace,
    Replicas,
    SlotRules,
    StandbyDropped,
    StandbyFinished,
    StandbyReady,
    StandbyStarting,
    StandbySubmitted,
    StartFinished,
    Starting,
    StartSubmitted,
    StepReturned,
    TearDown,
    TornDown,
    alive,
    calls,
    current,
    holders,
    joining,
    reduce,
    starts,
)
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
    its workers, kept here until the controller's thread lists them with the job's (when the
    group trains: a standby's, ``index`` None, and a replacement's still starting are not)."""

    def __init__(self, parent: ReplicatedWorkerGroup, index: int | None) -> None:
        self.parent, self.index = parent, index
        self.healths: tuple = ()

    def event(self, message: str, *, exc: BaseException | None = None) -> None:
        who = "the standby group" if self.index is None else f"replica group {self.index}"
        self.parent.record.event(f"{who}: {message}", exc=exc)

    def workers(self, healths: tuple) -> None:
        self.healths = healths

    def become(self, index: int) -> None:
        """The standby takes group ``index``'s place (its events are marked so from now)."""
        self.index = index


class RayLighthouse:
    """The job's torchft Lighthouse actor, on the head node: started, asked, killed."""

    def __init__(self, job: JobOptions, record: JobRecord) -> None:
        self.job, self.record = job, record
        self.actor = None

    def start(self) -> str:
        """A new Lighthouse (an older one killed first); returns its address.

        Raises:
            WorkerGroupFailure: a startup failure (retried as a worker start is, within
                ``cluster.max_failures``): the actor died, or did not answer within
                ``cluster.startup_timeout_seconds`` (a loaded head node; it is killed).
        """
        self.kill()
        cluster = self.job.cluster
        heartbeat_ms = round(cluster.replica_heartbeat_seconds * 1000)
        self.actor = ray.remote(Lighthouse).options(
            num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001}, max_restarts=0,
            name=f"ringray-{self.job.name}-lighthouse").remote(
            min_replicas=1, join_timeout_ms=heartbeat_ms, heartbeat_timeout_ms=heartbeat_ms)
        try:
            return ray.get(self.actor.address.remote(), timeout=cluster.startup_timeout_seconds)
        except ray.exceptions.RayError as exc:  # GetTimeoutError is one
            self.kill()
            timed_out = isinstance(exc, ray.exceptions.GetTimeoutError)
            why = (f"did not answer within {cluster.startup_timeout_seconds:g} s "
                   f"(cluster.startup_timeout_seconds)" if timed_out
                   else f"failed to start: {str(exc).splitlines()[0]}")
            raise WorkerGroupFailure(Failure(
                kind=FailureKind.STARTUP,
                detail=f"the torchft Lighthouse actor on the head node {why}")) from None

    def answers(self) -> bool:
        try:
            ray.get(self.actor.address.remote(), timeout=10)
            return True
        except Exception:
            return False

    def kill(self) -> None:
        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception as exc:
                self.record.event(f"the torchft Lighthouse could not be killed: {exc}",
                                  exc=exc)
            self.actor = None


def _membership(job: JobOptions, index: int | None, lighthouse: str | None,
                address: tuple[str, int] | None) -> ReplicaMembership:
    """Group ``index``'s place among the job's replica groups (None: the standby's, no place
    yet; ``address``: its rank 0's store)."""
    return ReplicaMembership(index=index, count=job.replicas, lighthouse=lighthouse,
                             store=address, **job.cluster.replica_settings())


# The calls run on the pool's threads: only Ray calls on the group they are given, and values
# computed from what they were handed; a value or an exception is their only way back.
def _start_and_build(group: RayWorkerGroup, place: Callable[[], tuple[PlacementPlan, str | None]],
                     options: TrainOptions, run: RunPlan,
                     membership: Callable[[tuple[str, int] | None], ReplicaMembership]
                     ) -> str | None:
    """A replacement from nothing: placed, started, built (no checkpoint: it heals at its
    first step). Returns the placement's warning, if any."""
    plan, warning = place()
    group.start(plan)
    group.build(options, run, replica=membership(group.address))
    return warning


def _take_place(group: RayWorkerGroup,
                membership: Callable[[tuple[str, int] | None], ReplicaMembership]) -> None:
    """The standby as a replacement: built ahead, it takes the lost group's place."""
    group.take_replica_place(membership(group.address))


def _prepare(group: RayWorkerGroup, place: Callable[[], tuple[PlacementPlan, str | None]],
             options: TrainOptions, run: RunPlan,
             membership: Callable[[tuple[str, int] | None], ReplicaMembership]
             ) -> tuple[str | None, str]:
    """The standby built ahead: placed, its workers up, its process group formed and its
    trainer built (fresh weights, no torchft manager: no place among the groups yet).
    Returns the placement's warning and its nodes."""
    plan, warning = place()
    group.start(plan)
    group.build(options, run, replica=membership(group.address))
    return warning, ", ".join(sorted(plan.slots_by_node()))


def _result(call: Future) -> tuple[BaseException | None, object]:
    """A finished call's exception (a cancelled call's included) or value."""
    try:
        return None, call.result(timeout=0)
    except CancelledError as exc:
        return exc, None
    except Exception as exc:
        return exc, None


class ReplicatedWorkerGroup:
    """The job's replica groups, seen by the state machine as one worker group.

    Every fact about the groups lives in :attr:`state` (:class:`~.replica_slots.Replicas`),
    read and changed only on the caller's thread, through :func:`~.replica_slots.reduce`.
    ``make_group``, ``live_nodes``, ``lighthouse`` and ``clock`` are seams for tests: a group
    of workers by name and record, the live nodes, the Lighthouse, and monotonic time."""

    def __init__(self, job: JobOptions, record: JobRecord, *,
                 should_stop: Callable[[], bool],
                 make_group: Callable[[str, _GroupRecord], RayWorkerGroup] | None = None,
                 live_nodes: Callable[[], list[NodeSnapshot]] | None = None,
                 lighthouse: RayLighthouse | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job, self.record, self.should_stop = job, record, should_stop
        self.count = job.train.parallel.dp_replicate
        self.cluster = job.cluster
        self.state = Replicas(rules=SlotRules(
            count=self.count, max_failures=self.cluster.max_failures,
            standby_wanted=self.cluster.replica_standby is not False,  # unset: when there is room
            retry_seconds=REPLACE_RETRY_SECONDS))
        self.lighthouse = lighthouse or RayLighthouse(job, record)
        self.lighthouse_address: str | None = None
        self.options: TrainOptions | None = None  # one group's options (its own dp)
        self.run: RunPlan | None = None
        self.clock = clock
        self._make_group = make_group or self._ray_group
        self._live_nodes = live_nodes or (lambda: schedulable_nodes(
            worker_resources=job.worker_resources, avoid=set()))
        self._incarnation = 0
        self._listed: tuple = ()  # the groups whose workers the job's list holds
        self._pool = ThreadPoolExecutor(max_workers=2 * self.count + 2,
                                        thread_name_prefix="ringray-replicas")

    # ----------------------------------------------------------------- the state, read
    @property
    def members(self) -> dict[int, RayWorkerGroup]:
        """The groups that train (live or joining), by index."""
        return {i: self.state.slots[i].group for i in alive(self.state)}

    @property
    def job_step(self) -> int:
        """The newest step a call of :meth:`step` returned."""
        return self.state.job_step

    @property
    def replacements(self) -> int:
        """Groups lost so far (counted against ``cluster.max_failures``)."""
        return self.state.losses

    def _group(self, index: int | None) -> RayWorkerGroup:
        """A new worker group for replica group ``index`` (None: the standby, which is named
        as a replica group so that the workers' memory check counts its bundles)."""
        self._incarnation += 1
        return self._make_group(f"ringray-{self.job.name}-replica"
                                f"{'-standby' if index is None else index}-{self._incarnation}",
                                _GroupRecord(self, index))

    def _ray_group(self, name: str, record: _GroupRecord) -> RayWorkerGroup:
        return RayWorkerGroup(self.job, record, should_stop=self.should_stop, name=name)

    # ----------------------------------------------------------------- the state, changed
    def _apply(self, event: Event) -> tuple[Action, ...]:
        """``event`` through the transitions; then their actions, in order (the live groups
        to be torn down are first asked to close, together, for at most
        :data:`~ringray.cluster.worker_group.CLOSE_SECONDS`). Raises JobError for
        :class:`GiveUp`; returns the actions (the caller handles :class:`Escalate`)."""
        self.state, actions = reduce(self.state, event, self.clock())
        closing = [ref for action in actions if isinstance(action, TearDown) and action.close
                   for ref in action.group.ask_to_close()]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_SECONDS)
        give_up = None
        for action in actions:
            if isinstance(action, TearDown):
                action.group.teardown()
            elif isinstance(action, Cancel):
                action.call.cancel()
            elif isinstance(action, Record):
                self.record.event(action.message)
            elif isinstance(action, RecordLost):
                self.record.replica_lost(action.index, reason=action.reason,
                                         detail=action.detail, left=action.left)
            elif isinstance(action, Replace):
                self._replace(action.index, from_standby=action.from_standby)
            elif isinstance(action, PrepareStandby):
                self._prepare_standby()
            elif isinstance(action, AwaitStarts):
                self._await_starts()
            elif isinstance(action, GiveUp):
                give_up = action
        self._list_workers()
        if give_up is not None:
            raise JobError(give_up.message)
        return actions

    def _list_workers(self) -> None:
        """The job's list of workers: the training groups', by index (when they changed)."""
        groups = tuple(self.state.slots[i].group for i in alive(self.state))
        if len(groups) == len(self._listed) and all(
                a is b for a, b in zip(groups, self._listed, strict=True)):
            return
        self._listed = groups
        if groups:
            self.record.workers(tuple(h for group in groups for h in group.record.healths))

    def _fail(self, index: int, exc: WorkerGroupFailure, during: str) -> None:
        """Group ``index`` failed ``during`` something: lost alone (torn down, its
        replacement started in the background) while another group holds the job's state;
        else ``exc`` goes on to the machine."""
        gone = False
        if during == "step" and any(i != index for i in holders(self.state)):
            gone = not self.lighthouse.answers()
        for action in self._apply(GroupFailed(index, exc.failure, during=during,
                                              lighthouse_gone=gone)):
            if isinstance(action, Escalate):
                if action.message:
                    self.record.event(action.message)
                raise exc
        self._apply(Due())

    def _sync(self) -> None:
        """The starts that have returned (replacements, the standby, abandoned ones) as
        events, then the replacements whose time has come started."""
        for call in [call for call in starts(self.state) if call.done()]:
            self._finished(call)
        self._apply(Due())

    def _finished(self, call: Future) -> None:
        error, value = _result(call)
        standby = [self.state.standby, *self.state.abandoned]
        if not any(isinstance(s, StandbyStarting) and s.call is call for s in standby):
            self._apply(StartFinished(call, error, note=value))
            return
        message = None
        if self.state.standby is None or self.state.standby.call is not call:
            pass  # an abandoned standby's: torn down, nothing to say
        elif error is None:
            warning, nodes = value
            if warning:
                self.record.event(f"the standby group: {warning}")
            message = f"a standby group is up on {nodes}, ready to replace a lost group"
        elif isinstance(error, PlacementError):
            message = self._no_room_for_standby()
        self._apply(StandbyFinished(call, error, message))

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
        """A new Lighthouse, then the R groups, started together; the first failure goes to
        the machine (whose teardown takes the others, started or still starting)."""
        self._start_lighthouse()
        for index, part in enumerate(split_plan(plan, self.count)):
            group = self._group(index)
            self._apply(StartSubmitted(index, group, self._pool.submit(group.start, part),
                                       replacement=False))
        self._wait_all([self.state.slots[i].call for i in range(self.count)])

    @staticmethod
    def _wait_all(calls: list[Future]) -> None:
        """Wait for every call; the first to fail raises (WorkerGroupFailure, JobError,
        StopRequested: to the machine) without waiting for the others."""
        wait(calls, return_when=FIRST_EXCEPTION)
        for call in calls:
            if call.done() and call.exception() is not None:
                raise call.exception()

    def _start_lighthouse(self) -> None:
        """A new Lighthouse for every start of the groups, the machine's restarts included:
        one that remembers a quorum of the groups before the restart would give the first
        group to ask a quorum of its own at once (torchft forms a quorum as soon as every
        member of the previous one has asked), and the others would wait out their quorum
        timeout. A new one knows only the groups that heartbeat to it, and each group's
        managers exist from its build (:meth:`ReplicaSync.attach
        <ringray.train.replicas.ReplicaSync.attach>`), so the first quorum waits for them."""
        self.lighthouse_address = self.lighthouse.start()
        self.record.event(f"torchft Lighthouse at {self.lighthouse_address} for "
                          f"{self.count} replica groups")

    def run_plan(self, *, lineage: str | None) -> RunPlan:
        return self.state.slots[0].group.run_plan(lineage=lineage)

    def _replica(self, index: int, group: RayWorkerGroup) -> ReplicaMembership:
        return _membership(self.job, index, self.lighthouse_address, group.address)

    def build(self, options: TrainOptions, run: RunPlan) -> Restored:
        """Every group opens its sessions and restores the same checkpoint (each reads it).
        ``options`` are one group's (``parallel.dp`` its own rings)."""
        self.options, self.run = options, run
        for index in range(self.count):
            group = self.state.slots[index].group
            self._apply(CallSent(index, self._pool.submit(
                group.build, options, run, replica=self._replica(index, group))))
        calls = [self.state.slots[i].call for i in range(self.count)]
        self._wait_all(calls)
        restored = [call.result() for call in calls]
        self._apply(Formed(steps={i: r.step for i, r in enumerate(restored)},
                           job_step=restored[0].step))
        return restored[0]

    # ----------------------------------------------------------------- replacing
    def _replace(self, index: int, *, from_standby: bool) -> None:
        """Start group ``index``'s replacement in the background: the standby joining where it
        is up on live nodes, else a new group placed apart from the live ones. Built with no
        checkpoint, it heals from a live peer at its first step."""
        run = RunPlan(lineage=self.run.lineage, restore=())
        membership = partial(_membership, self.job, index, self.lighthouse_address)
        group = self._take_standby(index) if from_standby else None
        joins = group is not None
        if joins:
            call = self._pool.submit(_take_place, group, membership)
        else:
            group = self._group(index)
            call = self._pool.submit(_start_and_build, group, self._placer(), self.options,
                                     run, membership)
        self._apply(StartSubmitted(index, group, call, from_standby=joins))

    def _take_standby(self, index: int) -> RayWorkerGroup | None:
        """The standby, if its nodes are all live (else it is torn down: None)."""
        group = self.state.standby.group
        live = {node.node_id for node in self._live_nodes()}
        if not set(group.plan_.slots_by_node()) <= live:
            self._apply(StandbyDropped())
            return None
        group.record.become(index)
        return group

    def _placer(self) -> Callable[[], tuple[PlacementPlan, str | None]]:
        """Where a new group goes, decided on the pool thread from the live nodes then and
        the slots the training groups and the standby hold now (:func:`replacement_plan`)."""
        used: dict[str, int] = {}
        holders_ = [self.state.slots[i].group for i in alive(self.state)]
        if isinstance(self.state.standby, StandbyReady):
            holders_.append(self.state.standby.group)
        for member in holders_:
            if member.plan_ is not None:
                for node, n in member.plan_.slots_by_node().items():
                    used[node] = used.get(node, 0) + n
        nodes, job, dp = self._live_nodes, self.job, self.options.parallel.dp
        return lambda: replacement_plan(nodes(), used, cp=job.cp, dp=dp,
                                        failure_domain=job.cluster.failure_domain,
                                        ulysses=job.ulysses)

    # ----------------------------------------------------------------- the standby
    def _prepare_standby(self) -> None:
        """Build one group ahead (in the background), on free slots apart from the live
        groups: its workers, process group and trainer (fresh weights, no checkpoint), all
        but a place among the groups and its torchft manager, so that a replacement only
        takes a place and heals (``cluster.replica_standby``). Building the model and the
        optimizer was most of a standby's replacement time when it was left to the
        replacement (2.2-2.8 s of 4.5 s on this 2-core machine)."""
        if self.options is None:
            return
        group = self._group(None)
        run = RunPlan(lineage=self.run.lineage, restore=())
        membership = partial(_membership, self.job, None, self.lighthouse_address)
        self._apply(StandbySubmitted(group, self._pool.submit(
            _prepare, group, self._placer(), self.options, run, membership)))

    def _no_room_for_standby(self) -> str:
        """Why there is no standby group, with the arithmetic of the slots."""
        need = self.options.parallel.dp * self.job.cp
        live = len(alive(self.state))
        total = sum(node.slots for node in self._live_nodes())
        slots = "slot" if need == 1 else "slots"
        return (f"no standby group: it needs {need} free worker {slots} (dp "
                f"{self.options.parallel.dp} × cp {self.job.cp}); the live nodes have {total}, "
                f"and the {live} live replica group(s) hold {live * need}, so a lost group's "
                f"replacement will start its processes when it is needed (add a node with "
                f"{need} {slots}, or set cluster.replica_standby: false to say none is wanted)")

    # ----------------------------------------------------------------- training
    def step(self, *, move_now: Callable[[Drain], str | None]) -> StepStats:
        """One step the replica groups committed (a step none committed is run again).

        The calls of the groups holding the job's state go out together and are waited for.
        A group that joins (a replacement) waits inside its first call for a quorum with
        theirs, heals there and trains that step with them, so its call is never waited on.
        Whenever a call returns a step the job already has (a joining group's, or one left
        from an earlier round), that group's next call goes out at once: the Lighthouse
        waits for every member of the last quorum, so the others' next step would otherwise
        wait for it until the quorum timeout."""
        failure = None
        for _ in range(UNCOMMITTED_ATTEMPTS):
            self._sync()
            for index in alive(self.state):
                if self.state.slots[index].call is None:
                    self._send(index, move_now)
            waiting = set(holders(self.state))
            committed: list[tuple[int, StepStats]] = []
            resent: set[int] = set()
            first: set[int] = set()  # replacements' first calls, sent into the others' quorum
            while waiting & set(calls(self.state)):
                watch = set(waiting) | set(joining(self.state))
                watched = {call: i for i, call in calls(self.state).items() if i in watch}
                replacing = [s.call for s in self.state.slots.values()
                             if isinstance(s, Starting) and s.call is not None]
                done, _ = wait([*watched, *replacing], return_when=FIRST_COMPLETED)
                if any(call not in watched for call in done):
                    # A replacement is up: its torchft manager heartbeats, so the others'
                    # quorum now waits for it (the Lighthouse wants more than half of the
                    # groups that heartbeat); its first call goes out at once, into that
                    # quorum, instead of at the next step (never: the others' step waits).
                    for call in done:
                        if call not in watched:
                            self._finished(call)
                    for index in joining(self.state):
                        if self.state.slots[index].call is None:
                            self._send(index, move_now)
                            first.add(index)
                for call in [call for call in done if call in watched]:
                    index = watched[call]
                    joined = isinstance(self.state.slots.get(index), Joining)
                    waiting.discard(index)
                    stats = self._outcome(index)
                    if isinstance(stats, Failure):
                        failure = stats
                    elif stats.committed and stats.step > self.job_step:
                        committed.append((index, stats))
                    elif index in alive(self.state) and (joined or stats.committed):
                        # A joining group's first call, or a call left from an earlier round
                        # (a step the job already has): the group's next call goes out now,
                        # for the quorum the others wait in (the Lighthouse waits for every
                        # member of the last quorum). It is waited for in a later round.
                        self._send(index, move_now)
                        resent.add(index)
            # A call sent again above is most often in the quorum the others just finished:
            # it returns with them, and taking it now keeps the groups in step. So does a
            # replacement's first call when the others' step counted it (it heals first, so
            # it may return a little after them): the step is then recorded as healed. One
            # the others' step did not count waits for their next quorum: not waited for.
            counted = {i for _, stats in committed for i in stats.replicas_participating}
            committed += self._settle(resent | (first & counted))
            if committed:
                stats = max(committed, key=lambda c: (c[1].step, -c[0]))[1]
                self._apply(JobStepped(stats.step))
                return _with_heals(stats, [s for _, s in committed if s.step == stats.step])
        raise WorkerGroupFailure(failure or Failure(
            kind=FailureKind.HANG, detail=f"no replica group committed a step in "
                                          f"{UNCOMMITTED_ATTEMPTS} attempts"))

    def _send(self, index: int, move_now: Callable[[Drain], str | None]) -> None:
        group = self.state.slots[index].group
        self._apply(CallSent(index, self._pool.submit(group.step, move_now=move_now)))

    def _settle(self, indices: set[int]) -> list[tuple[int, StepStats]]:
        """Take the calls of ``indices`` that return within :data:`SETTLE_SECONDS`; the rest
        stay in flight (waiting for a later quorum). Returns the new committed steps."""
        inflight = calls(self.state)
        watched = {inflight[i]: i for i in indices if i in inflight}
        if not watched:
            return []
        done, _ = wait(watched, timeout=SETTLE_SECONDS)
        fresh = []
        for call in done:
            index = watched[call]
            stats = self._outcome(index)
            if isinstance(stats, StepStats) and stats.committed and stats.step > self.job_step:
                fresh.append((index, stats))
        return fresh

    def _outcome(self, index: int) -> StepStats | Failure:
        """Take group ``index``'s finished step call: a failure loses the group (or, for the
        last one holding the job's state, goes to the machine), a heal is recorded, a commit
        marks its step."""
        call = self.state.slots[index].call
        try:
            stats = call.result()
        except WorkerGroupFailure as exc:
            self._fail(index, exc, "step")
            return exc.failure
        self._apply(StepReturned(index, stats.step, stats.committed))
        if stats.healed:
            self.record.replica_healed(index, step=stats.step, seconds=stats.heal_seconds)
        return stats

    def _one_group(self, call: Callable[[RayWorkerGroup], object], during: str) -> object:
        """``call`` on the lowest current group; on its failure that group is lost alone
        (while another holds the job's state) and the next one is asked."""
        failure = None
        for index in current(self.state):
            slot = self.state.slots.get(index)
            if not isinstance(slot, Live | Joining):
                continue
            try:
                return call(slot.group)
            except WorkerGroupFailure as exc:
                failure = exc
                self._fail(index, exc, during)
        raise failure or WorkerGroupFailure(Failure(kind=FailureKind.HANG,
                                                    detail="no replica group is live"))

    def checkpoint(self) -> Saved:
        """One group saves; then every group at the current step compares its state with
        it, rank for rank (weights, optimizer state, loader, RNG, step). A group that holds
        another state heals from a live peer at the next step (:meth:`_compare_states`). A
        group that fails in either is lost alone while another holds the job's state."""
        self._settle(set(calls(self.state)))  # a group's call still returning this step
        saved = self._one_group(lambda group: group.checkpoint(), "checkpoint")
        self._compare_states(saved.checkpoint.step)
        return saved

    def _compare_states(self, step: int) -> None:
        """The current groups' state digests against the first one's (the group that saved).
        A group that differs falls behind (:meth:`ReplicaSync.fall_behind
        <ringray.train.replicas.ReplicaSync.fall_behind>`): at the next step torchft heals it
        from a live peer, so gradients of different weights are never averaged again. A group
        that fails meanwhile is lost alone, as in a step."""
        digests: dict[int, list[str]] = {}
        for index in current(self.state):
            try:
                digests[index] = self.state.slots[index].group.state_digests()
            except WorkerGroupFailure as exc:
                self._fail(index, exc, "digest")
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
            slot = self.state.slots.get(index)
            if not isinstance(slot, Live | Joining):
                continue
            try:
                slot.group.fall_behind()
            except WorkerGroupFailure as exc:
                self._fail(index, exc, "digest")

    def evaluate(self) -> PasskeyReport | None:
        return self._one_group(lambda group: group.evaluate(), "evaluate")

    def evaluate_tasks(self, step: int) -> dict[str, str] | None:
        return self._one_group(lambda group: group.evaluate_tasks(step), "evaluate")

    def poll(self) -> None:
        self._sync()
        for index in alive(self.state):
            slot = self.state.slots.get(index)
            if not isinstance(slot, Live | Joining):
                continue
            try:
                slot.group.poll()
            except WorkerGroupFailure as exc:
                self._fail(index, exc, "poll")

    def take_drain(self) -> Drain | None:
        for group in self.members.values():
            drain = group.take_drain()
            if drain is not None:
                return drain
        return None

    # ----------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Every group, the starts in flight and the standby; the Lighthouse stays for the
        job's next start (:meth:`close` ends it).

        The live groups' workers are first asked to shut their torchft managers down (at
        most :data:`~ringray.cluster.worker_group.CLOSE_SECONDS`). A start in flight is
        cancelled if it has not begun, its group torn down where it is, and it is then
        waited for, at most :data:`TEARDOWN_WAIT_SECONDS`, and whatever its group made
        meanwhile torn down too (:meth:`_await_starts`); nothing of it is adopted later."""
        self._apply(TornDown())

    def _await_starts(self) -> None:
        """The starts a teardown abandoned, waited for (at most
        :data:`TEARDOWN_WAIT_SECONDS`); each that returned has its group torn down again. One
        still running is recorded, and torn down when it returns (at the next teardown or
        :meth:`step`, or by :meth:`close`)."""
        pending = [entry.call for entry in self.state.abandoned]
        _, running = wait(pending, timeout=TEARDOWN_WAIT_SECONDS)
        for call in pending:
            if call.done():
                self._finished(call)
        if running:
            self.record.event(f"warning: {len(running)} replica group start(s) still running "
                              f"{TEARDOWN_WAIT_SECONDS:.0f} s after the teardown; their groups "
                              f"are torn down when they return")

    def close(self) -> None:
        """The job has ended: the groups and the Lighthouse go. A start still running past
        the teardown's wait has its group torn down when it returns (the one thing a pool
        thread does besides its calls: that group is no longer the job's)."""
        self.teardown()
        for entry in self.state.abandoned:
            entry.call.add_done_callback(lambda _call, group=entry.group: group.teardown())
        self._kill_lighthouse()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _kill_lighthouse(self) -> None:
        self.lighthouse.kill()
        self.lighthouse_address = None
