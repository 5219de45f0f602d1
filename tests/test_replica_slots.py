"""The replica groups' slots (:mod:`ringray.cluster.replica_slots`), one transition at a time,
and :class:`~ringray.cluster.replica_groups.ReplicatedWorkerGroup` driven against fake groups
(no Ray): a group lost in a step, a checkpoint or a digest is lost alone; a replacement that
comes up after a teardown is torn down, never adopted; a teardown waits for the starts in
flight and tears down what they made; ``cluster.max_failures`` ends the job; and when no group
holding the job's state is left, the failure reaches the machine. After each fault and after
the job, the fakes' placement groups and actors are counted: none may be left over.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from concurrent.futures import wait
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from train_cases import tiny_options

from ringray.cluster import replica_groups
from ringray.cluster.errors import JobError, StopRequested, WorkerGroupFailure
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.machine import JobMachine
from ringray.cluster.placement import NodeSnapshot, plan_placement
from ringray.cluster.policy import Failure, FailureKind
from ringray.cluster.record import JobRecord
from ringray.cluster.replica_groups import ReplicatedWorkerGroup
from ringray.cluster.replica_slots import (
    AwaitStarts,
    CallSent,
    Cancel,
    Due,
    Escalate,
    Formed,
    GiveUp,
    GroupFailed,
    JobStepped,
    Joining,
    Live,
    Lost,
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
    current,
    holders,
    reduce,
    starts,
)
from ringray.cluster.states import Recovering, Running
from ringray.cluster.states import Starting as MachineStarting
from ringray.metrics import MetricsOptions
from ringray.train import CheckpointRef, StepStats
from ringray.train.checkpoint_runs import RunPlan
from ringray.train.session import Restored, Saved

pytestmark = pytest.mark.timeout(60)

NOW = 100.0
DIED = Failure(kind=FailureKind.ACTOR_DIED, detail="rank 0 died")


@dataclass(eq=False)
class H:
    """An opaque handle (a group or a call), named for the messages of failed asserts."""

    name: str

    def __repr__(self) -> str:
        return self.name


G0, G1, G2, GS, C0, C1, C2, CS = (H(n) for n in ("g0", "g1", "g2", "gs", "c0", "c1", "c2",
                                                 "cs"))


def _state(slots, *, standby=None, losses=0, job_step=8, max_failures=3, wanted=False,
           abandoned=()) -> Replicas:
    return Replicas(rules=SlotRules(count=3, max_failures=max_failures, standby_wanted=wanted),
                    slots=slots, standby=standby, losses=losses, job_step=job_step,
                    abandoned=abandoned)


def _lost_alone(during: str, detail: str):
    return (
        _state({0: Live(G0, 8), 1: Live(G1, 8, call=C1)}),
        GroupFailed(1, DIED, during=during),
        {0: Live(G0, 8), 1: Lost("actor_died", NOW)},
        (RecordLost(1, reason="actor_died", detail=detail, left=1), TearDown(G1)),
    )


# (name, state, event, the slots after, the actions): every transition and its actions.
TABLE = [
    ("a live group's committed step", _state({0: Live(G0, 8, call=C0)}),
     StepReturned(0, 9, committed=True), {0: Live(G0, 9)}, ()),
    ("a live group's uncommitted step keeps its step", _state({0: Live(G0, 8, call=C0)}),
     StepReturned(0, 8, committed=False), {0: Live(G0, 8)}, ()),
    ("a joining group at a step the job has stays joining",
     _state({0: Live(G0, 8), 1: Joining(G1, 90.0, call=C1)}),
     StepReturned(1, 8, committed=True), {0: Live(G0, 8), 1: Joining(G1, 90.0, step=8)}, ()),
    ("a joining group past the job's step holds the state",
     _state({0: Live(G0, 8), 1: Joining(G1, 90.0, call=C1)}),
     StepReturned(1, 9, committed=True), {0: Live(G0, 8), 1: Live(G1, 9)}, ()),
    ("a call sent", _state({0: Live(G0, 8)}), CallSent(0, C0), {0: Live(G0, 8, call=C0)}, ()),
    ("lost in a step", *_lost_alone("step", "rank 0 died")),
    ("lost in a checkpoint", *_lost_alone("checkpoint", "rank 0 died; during a checkpoint")),
    ("lost in a digest", *_lost_alone("digest",
                                       "rank 0 died; while comparing state digests")),
    ("a joining group lost while a live one holds the state",
     _state({0: Live(G0, 8), 1: Joining(G1, 90.0)}), GroupFailed(1, DIED),
     {0: Live(G0, 8), 1: Lost("actor_died", NOW)},
     (RecordLost(1, reason="actor_died", detail="rank 0 died", left=1), TearDown(G1))),
    ("the last holder: to the machine, naming the joining group",
     _state({0: Live(G0, 8), 1: Joining(G1, 90.0)}), GroupFailed(0, DIED, during="checkpoint"),
     {0: Live(G0, 8), 1: Joining(G1, 90.0)},
     (Escalate("replica group 0 was the last group holding the job's state (group 1 had not "
               "healed yet): the job restarts from its checkpoint"),)),
    ("the only group: to the machine", _state({0: Live(G0, 8), 1: Lost("x", math.inf)}),
     GroupFailed(0, DIED, during="digest"), {0: Live(G0, 8), 1: Lost("x", math.inf)},
     (Escalate(None),)),
    ("the Lighthouse gone: to the machine", _state({0: Live(G0, 8), 1: Live(G1, 8)}),
     GroupFailed(1, DIED, lighthouse_gone=True), {0: Live(G0, 8), 1: Live(G1, 8)},
     (Escalate("the torchft Lighthouse is gone: no group can form a quorum, so the job "
               "restarts from its checkpoint"),)),
    ("an already lost group's late failure", _state({0: Live(G0, 8), 1: Lost("x", NOW)}),
     GroupFailed(1, DIED), {0: Live(G0, 8), 1: Lost("x", NOW)}, ()),
    ("max_failures exhausted", _state({0: Live(G0, 8), 1: Live(G1, 8)}, losses=3),
     GroupFailed(1, DIED), {0: Live(G0, 8), 1: Lost("actor_died", math.inf)},
     (RecordLost(1, reason="actor_died", detail="rank 0 died", left=1), TearDown(G1),
      GiveUp("replica groups lost 4 times, more than cluster.max_failures: 3; last: replica "
             "group 1, rank 0 died"))),
    ("a replacement submitted", _state({0: Live(G0, 8), 1: Lost("x", NOW)}),
     StartSubmitted(1, G1, C1), {0: Live(G0, 8), 1: Starting(G1, C1, 0, NOW)}, ()),
    ("a replacement up joins", _state({0: Live(G0, 8), 1: Starting(G1, C1, 0, 90.0)},
                                      wanted=True),
     StartFinished(C1), {0: Live(G0, 8), 1: Joining(G1, NOW)},
     (Record("replica group 1 replaced in 10.0 s; it heals from a live peer at its first "
             "step"), PrepareStandby())),
    ("a replacement up, with a placement warning",
     _state({0: Live(G0, 8), 1: Starting(G1, C1, 0, 90.0)}),
     StartFinished(C1, note="warning: shared"), {0: Live(G0, 8), 1: Joining(G1, NOW)},
     (Record("replica group 1: warning: shared"),
      Record("replica group 1 replaced in 10.0 s; it heals from a live peer at its first "
             "step"))),
    ("a replacement that failed to start is retried later",
     _state({0: Live(G0, 8), 1: Starting(G1, C1, 0, 90.0)}),
     StartFinished(C1, error=RuntimeError("no room")),
     {0: Live(G0, 8), 1: Lost("start failed", NOW + 5.0)},
     (TearDown(G1), Record("replica group 1's replacement did not start: no room; trying "
                           "again in 5 s (the others train on)"))),
    ("the standby that could not join: a new group at once",
     _state({0: Live(G0, 8), 1: Starting(G1, C1, 0, 90.0, from_standby=True)}),
     StartFinished(C1, error=RuntimeError("gone")),
     {0: Live(G0, 8), 1: Lost("standby failed", NOW)},
     (TearDown(G1), Record("replica group 1: the standby group could not join (gone); "
                           "starting a replacement"))),
    ("a replacement stopped with the job",
     _state({0: Live(G0, 8), 1: Starting(G1, C1, 0, 90.0)}),
     StartFinished(C1, error=StopRequested("stop")),
     {0: Live(G0, 8), 1: Lost("stopped", math.inf)}, (TearDown(G1),)),
    ("a start of the job's own start is left to start()",
     _state({0: Starting(G0, C0, 0, 90.0, replacement=False)}), StartFinished(C0),
     {0: Starting(G0, C0, 0, 90.0, replacement=False)}, ()),
    ("a replacement of an earlier generation is torn down, not adopted",
     _state({0: Live(G0, 8), 1: Starting(G1, C1, 1, 95.0)},
            abandoned=(Starting(G2, C2, 0, 90.0),)),
     StartFinished(C2), {0: Live(G0, 8), 1: Starting(G1, C1, 1, 95.0)}, (TearDown(G2),)),
    ("due: the standby for the first, a new group for the next",
     _state({0: Live(G0, 8), 1: Lost("x", NOW), 2: Lost("x", NOW - 1)},
            standby=StandbyReady(GS)),
     Due(), {0: Live(G0, 8), 1: Lost("x", NOW), 2: Lost("x", NOW - 1)},
     (Replace(1, from_standby=True), Replace(2, from_standby=False))),
    ("due: not before the retry time", _state({0: Live(G0, 8), 1: Lost("x", NOW + 1)}), Due(),
     {0: Live(G0, 8), 1: Lost("x", NOW + 1)}, ()),
    ("due: waits for the standby still starting",
     _state({0: Live(G0, 8), 1: Lost("x", NOW)}, standby=StandbyStarting(GS, CS, 0, 90.0)),
     Due(), {0: Live(G0, 8), 1: Lost("x", NOW)}, ()),
    ("due: nothing while no group trains", _state({0: Lost("x", NOW), 1: Lost("x", NOW)}),
     Due(), {0: Lost("x", NOW), 1: Lost("x", NOW)}, ()),
    ("formed: every group live at its step, then a standby",
     _state({0: Starting(G0, C0, 0, 90.0, replacement=False),
             1: Starting(G1, C1, 0, 90.0, replacement=False)}, wanted=True),
     Formed({0: 4, 1: 4}, job_step=4), {0: Live(G0, 4), 1: Live(G1, 4)}, (PrepareStandby(),)),
]


@pytest.mark.parametrize(("name", "state", "event", "slots", "actions"), TABLE,
                         ids=[row[0] for row in TABLE])
def test_each_transition_gives_its_next_slots_and_actions(name, state, event, slots,
                                                          actions) -> None:
    after, done = reduce(state, event, NOW)
    assert dict(after.slots) == slots
    assert done == actions


def test_losses_count_and_the_job_step_and_standby_follow_their_events() -> None:
    state = _state({0: Live(G0, 8), 1: Live(G1, 8), 2: Live(G2, 8)})
    state, _ = reduce(state, GroupFailed(1, DIED), NOW)
    state, _ = reduce(state, GroupFailed(2, DIED, during="poll"), NOW)
    assert state.losses == 2 and holders(state) == [0]
    state, _ = reduce(state, JobStepped(9), NOW)
    assert state.job_step == 9
    state, _ = reduce(state, StandbySubmitted(GS, CS), NOW)
    assert state.standby == StandbyStarting(GS, CS, 0, NOW) and starts(state) == [CS]
    with pytest.raises(ValueError, match="already there"):
        reduce(state, StandbySubmitted(GS, CS), NOW)
    ready, actions = reduce(state, StandbyFinished(CS, message="up on n3"), NOW)
    assert ready.standby == StandbyReady(GS) and actions == (Record("up on n3"),)
    failed, actions = reduce(state, StandbyFinished(CS, error=RuntimeError("x")), NOW)
    assert failed.standby is None and actions[0] == TearDown(GS)
    dropped, actions = reduce(ready, StandbyDropped(), NOW)
    assert dropped.standby is None and actions == (TearDown(GS),)
    taken, _ = reduce(ready, StartSubmitted(1, GS, C1, from_standby=True), NOW)
    assert taken.standby is None and taken.slots[1] == Starting(GS, C1, 0, NOW,
                                                                from_standby=True)
    with pytest.raises(ValueError, match="replica slot 0 is Live, not free"):
        reduce(state, StartSubmitted(0, G0, C0), NOW)


def test_a_teardown_starts_a_generation_and_abandons_the_starts_in_flight() -> None:
    state = _state({0: Live(G0, 8, call=C0), 1: Starting(G1, C1, 0, 90.0), 2: Lost("x", NOW)},
                   standby=StandbyStarting(GS, CS, 0, 90.0))
    after, actions = reduce(state, TornDown(), NOW)
    assert actions == (TearDown(G0, close=True), Cancel(C0), Cancel(C1), TearDown(G1),
                       Cancel(CS), TearDown(GS), AwaitStarts())
    assert after.slots == {} and after.standby is None and after.generation == 1
    assert starts(after) == [C1, CS]
    # the standby's start returning now is torn down again, never made ready
    after, actions = reduce(after, StandbyFinished(CS, message="up"), NOW)
    assert actions == (TearDown(GS),) and after.standby is None and starts(after) == [C1]
    # nothing to wait for: no AwaitStarts
    assert reduce(_state({0: Live(G0, 8)}, standby=StandbyReady(GS)), TornDown(), NOW)[1] == (
        TearDown(G0, close=True), TearDown(GS))


def test_the_slots_module_loads_no_ray() -> None:
    code = ("import sys, ringray.cluster.replica_slots; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=30)
    assert out.stdout.strip() == "[]"


def test_the_current_groups_are_those_at_the_newest_committed_step() -> None:
    state = _state({0: Live(G0, 8), 1: Live(G1, 9), 2: Joining(G2, 90.0, step=9),
                    3: Joining(H("g3"), 90.0)})
    assert current(state) == [1, 2]
    assert current(_state({0: Joining(G0, 90.0)})) == []


# ----------------------------------------------------------------- against fake groups
def _stats(step: int, *, healed: bool = False, participating: tuple[int, ...] = ()
           ) -> StepStats:
    return StepStats(
        step=step, loss=2.5, grad_norm=0.75, learning_rate=1e-3, step_seconds=0.2, tokens=128,
        tokens_per_second=640.0, attention_compute_seconds=[0.1], exposed_comm_seconds=[0.0],
        overlap_ratio=1.0, load_imbalance=1.0, mfu=None, peak_memory_bytes=1, healed=healed,
        heal_seconds=0.5 if healed else 0.0, replicas_participating=list(participating))


class World:
    """What the fake groups hold between them (placement groups, actors), what they are to
    do wrong (``fail[(index, call)]``), and which starts are held (``hold``: until the test
    releases ``gate``; ``hold_until_torn``: until their own group is torn down)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.placement_groups: set[str] = set()
        self.actors: set[str] = set()
        self.fail: dict[tuple[int | None, str], BaseException] = {}
        self.hold: set[int] = set()
        self.hold_until_torn: set[int] = set()
        self.gate = threading.Event()
        self.held = threading.Event()  # a held start has begun (so it cannot be cancelled)
        self.groups: list[FakeGroup] = []
        self.digests: dict[int, list[str]] = {}
        # The Lighthouse's rule when a replacement's manager heartbeats: group 0's quorum
        # waits (up to 10 s, then its step fails) for group 1's first step.
        self.quorum_waits = False
        self.joined = threading.Event()
        self.joiner_lags = 0.0  # seconds group 1's call returns after it joined (its heal)

    def make(self, name: str, record) -> FakeGroup:
        group = FakeGroup(self, name, record)
        with self.lock:
            self.groups.append(group)
        return group

    def left(self) -> tuple[int, int]:
        with self.lock:
            return len(self.placement_groups), len(self.actors)


class FakeGroup:
    """One replica group's workers, instantly; a fresh one (built with nothing to restore)
    heals at its first step to the newest step any group committed."""

    def __init__(self, world: World, name: str, record) -> None:
        self.world, self.name, self.record = world, name, record
        self.plan_ = None
        self.address = None
        self.step_count = 0
        self.fresh = False
        self.torn = threading.Event()
        self.teardowns = 0
        self.behind = False
        self.made_after_teardown = False

    def _call(self, name: str) -> None:
        failure = self.world.fail.pop((self.record.index, name), None)
        if failure is not None:
            raise failure

    def start(self, plan) -> None:
        self.prepare(plan)
        self.join_group()

    def prepare(self, plan) -> None:
        if self.record.index in self.world.hold | self.world.hold_until_torn:
            self.world.held.set()
        if self.record.index in self.world.hold:
            assert self.world.gate.wait(20), "the test never released the held start"
        if self.record.index in self.world.hold_until_torn:
            assert self.torn.wait(20), "the held start's group was never torn down"
            self.made_after_teardown = True
        self._call("start")
        self.plan_ = plan
        with self.world.lock:  # made now, even if a teardown came meanwhile
            self.world.placement_groups.add(self.name)
            self.world.actors.update(f"{self.name}/{r.rank}" for r in plan.ranks)
        self.record.workers(tuple(f"{self.name}/{r.rank}" for r in plan.ranks))

    def join_group(self) -> None:
        self._call("join")
        self.address = ("127.0.0.1", 29500)

    def run_plan(self, *, lineage):
        return RunPlan(lineage=lineage or "run-1", restore=())

    def build(self, options, run, *, replica) -> Restored:
        # the standby is built ahead with no place (index None), as its record says
        assert replica.index == self.record.index and replica.lighthouse == "http://lh"
        assert replica.store == self.address  # its process group is formed first
        self._call("build")
        if replica.index is not None:
            self._heal_at_first_step()
        return Restored(step=0, checkpoint=None)

    def take_replica_place(self, replica) -> None:
        assert self.record.index is not None and replica.index == self.record.index
        assert self.address is not None and replica.store == self.address
        self._call("take_place")
        self._heal_at_first_step()

    def _heal_at_first_step(self) -> None:
        with self.world.lock:  # a replacement: it heals at its first step to the others' next
            newest = max(g.step_count for g in self.world.groups)
        self.fresh = newest > 0
        self.step_count = newest

    def step(self, *, move_now) -> StepStats:
        self._call("step")
        if self.world.quorum_waits and self.record.index == 1:
            self.world.joined.set()
            time.sleep(self.world.joiner_lags)
        if self.world.quorum_waits and self.record.index == 0:
            self.world.gate.set()  # the held replacement comes up while this step waits
            if not self.world.joined.wait(10):
                raise _died("quorum timeout: the replacement never asked")
        healed, self.fresh = self.fresh, False
        self.step_count += 1
        # in the quorum the replacement joined, both groups take part
        both = (0, 1) if self.world.quorum_waits else ()
        return _stats(self.step_count, healed=healed, participating=both)

    def checkpoint(self) -> Saved:
        self._call("checkpoint")
        return Saved(checkpoint=CheckpointRef(step=self.step_count, location=f"mem://{self.name}",
                                              lineage="run-1"))

    def state_digests(self) -> list[str]:
        self._call("digest")
        return self.world.digests.get(self.record.index, ["same"])

    def fall_behind(self) -> None:
        self.behind = True

    def evaluate(self):
        self._call("evaluate")

    def poll(self) -> None:
        self._call("poll")

    def take_drain(self):
        return None

    def ask_to_close(self) -> list:
        return []

    def teardown(self) -> None:
        self.teardowns += 1
        with self.world.lock:
            self.world.placement_groups.discard(self.name)
            self.world.actors.difference_update({a for a in self.world.actors
                                                 if a.startswith(f"{self.name}/")})
        self.torn.set()


class FakeLighthouse:
    def __init__(self) -> None:
        self.up = True

    def start(self) -> str:
        return "http://lh"

    def answers(self) -> bool:
        return self.up

    def kill(self) -> None:
        self.up = False


class FakeRecord:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.lost: list[tuple[int, str]] = []
        self.healed: list[int] = []
        self.listed: list[tuple] = []

    def event(self, message: str, *, exc: BaseException | None = None) -> None:
        self.events.append(message)

    def replica_lost(self, index: int, *, reason: str, detail: str, left: int) -> None:
        self.lost.append((index, detail))

    def replica_healed(self, index: int, *, step: int, seconds: float) -> None:
        self.healed.append(index)

    def workers(self, healths: tuple) -> None:
        self.listed.append(healths)


NODES = [NodeSnapshot(node_id=f"n{i}", slots=1) for i in range(6)]


def _job(tmp_path: Path, *, count: int = 2, standby: bool = False,
         max_failures: int = 3) -> JobOptions:
    train = tiny_options(str(tmp_path / "run"), parallel={"dp": 1, "cp": 1,
                                                          "dp_replicate": count},
                         train={"steps": 50, "global_batch": count})
    return JobOptions(name="r", train=train, metrics=MetricsOptions(port=None),
                      cluster=ClusterOptions(max_failures=max_failures, poll_seconds=0.5,
                                             replica_standby=standby))


def _groups(tmp_path: Path, world: World, record=None, **job) -> ReplicatedWorkerGroup:
    return ReplicatedWorkerGroup(_job(tmp_path, **job), record or FakeRecord(),
                                 should_stop=lambda: False, make_group=world.make,
                                 live_nodes=lambda: NODES, lighthouse=FakeLighthouse())


def _plan(count: int):
    return plan_placement(NODES[:count], cp=1, dp_options=(count,))


def _started(groups: ReplicatedWorkerGroup) -> ReplicatedWorkerGroup:
    groups.start(_plan(groups.count))
    options = groups.job.train
    groups.build(replace(options, parallel=replace(options.parallel, dp=1)),
                 groups.run_plan(lineage=None))
    return groups


def _settle_starts(groups: ReplicatedWorkerGroup, *, take: bool = False) -> None:
    """Let the starts in flight return; ``take``: take them now (else at the next step)."""
    wait(starts(groups.state), timeout=10)
    if take:
        groups.poll()


def _died(detail: str = "rank 0 died") -> WorkerGroupFailure:
    return WorkerGroupFailure(Failure(kind=FailureKind.ACTOR_DIED, detail=detail))


def _lose_group_1_and_hold_its_replacement(groups: ReplicatedWorkerGroup,
                                           world: World) -> None:
    """A step, then group 1 dies in the next; its replacement's start is held (in flight)."""
    groups.step(move_now=lambda d: None)
    world.hold.add(1)
    world.fail[(1, "step")] = _died()
    groups.step(move_now=lambda d: None)
    assert world.held.wait(10)


def _kinds(groups: ReplicatedWorkerGroup) -> dict[int, str]:
    return {i: type(s).__name__ for i, s in groups.state.slots.items()}


def test_a_group_lost_in_a_step_is_replaced_and_heals_while_the_other_trains(tmp_path) -> None:
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record))
    try:
        assert groups.step(move_now=lambda d: None).step == 1
        world.fail[(1, "step")] = _died()
        assert groups.step(move_now=lambda d: None).step == 2  # group 0's, alone
        assert record.lost == [(1, "rank 0 died")] and _kinds(groups)[1] == "Starting"
        assert world.groups[1].teardowns == 1 and groups.replacements == 1
        _settle_starts(groups)
        assert world.left() == (2, 2)  # group 0 and the replacement: nothing of the lost one
        stats = groups.step(move_now=lambda d: None)  # the replacement joins, heals, trains
        assert stats.step == 3 and stats.healed and record.healed == [1]
        assert _kinds(groups) == {0: "Live", 1: "Live"}
        assert groups.step(move_now=lambda d: None).step == 4
        assert any(e.startswith("replica group 1 replaced in ") for e in record.events)
        assert len(record.listed[-1]) == 2  # the job's workers: both groups'
    finally:
        groups.close()
    assert world.left() == (0, 0)


@pytest.mark.parametrize("call", ["checkpoint", "digest"])
def test_a_group_lost_in_a_checkpoint_or_its_digest_is_lost_alone(tmp_path, call) -> None:
    """Group 0 saves; if it dies saving, group 1 saves instead; a group dying while its
    digest is taken is lost alone. Either way the checkpoint stands and group 0 is
    replaced in the background (it used to restart the whole job from its checkpoint)."""
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record, count=3))
    try:
        groups.step(move_now=lambda d: None)
        world.fail[(0, call)] = _died()
        saved = groups.checkpoint()
        assert saved.checkpoint.step == 1
        during = {"checkpoint": "during a checkpoint",
                  "digest": "while comparing state digests"}[call]
        assert record.lost == [(0, f"rank 0 died; {during}")]
        assert saved.checkpoint.location == ("mem://ringray-r-replica1-2" if call == "checkpoint"
                                             else "mem://ringray-r-replica0-1")
        assert "replica groups 1, 2 hold identical state at step 1 (digest same)" in (
            record.events)
        _settle_starts(groups)
        assert world.left() == (3, 3)
        assert groups.step(move_now=lambda d: None).step == 2
        assert _kinds(groups) == {0: "Live", 1: "Live", 2: "Live"}
    finally:
        groups.close()
    assert world.left() == (0, 0)


def test_a_group_whose_digest_differs_falls_behind(tmp_path) -> None:
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record, count=3))
    try:
        groups.step(move_now=lambda d: None)
        world.digests = {0: ["a"], 1: ["a"], 2: ["x"]}
        groups.checkpoint()
        assert [g.behind for g in world.groups] == [False, False, True]
        assert ("warning: replica groups 0, 1, 2 differ at step 1: group(s) 2 hold another "
                "state than group 0, which saved it; they heal from a live peer at the next "
                "step") in record.events
        assert record.lost == []
    finally:
        groups.close()
    assert world.left() == (0, 0)


def test_at_a_checkpoint_one_group_differs_and_another_dies_computing_its_digest(
        tmp_path) -> None:
    """Four groups: group 2 holds another state (it falls behind, to heal at its next step),
    group 1 dies while computing its digest (lost alone, its replacement started); the
    checkpoint stands and the job goes on."""
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record, count=4))
    try:
        groups.step(move_now=lambda d: None)
        world.digests = {0: ["a", "b"], 2: ["a", "x"], 3: ["a", "b"]}
        world.fail[(1, "digest")] = _died()
        assert groups.checkpoint().checkpoint.step == 1
        assert [g.behind for g in world.groups[:4]] == [False, False, True, False]
        assert record.lost == [(1, "rank 0 died; while comparing state digests")]
        assert ("warning: replica groups 0, 2, 3 differ at step 1: group(s) 2 hold another "
                "state than group 0, which saved it; they heal from a live peer at the next "
                "step") in record.events
        assert isinstance(groups.state.slots[1], Starting) and world.groups[1].teardowns == 1
    finally:
        groups.close()
    assert world.left() == (0, 0)


def test_the_only_group_failing_its_checkpoint_goes_to_the_machine(tmp_path) -> None:
    world = World()
    groups = _started(_groups(tmp_path, world))
    try:
        groups.step(move_now=lambda d: None)
        world.fail[(1, "step")] = _died()
        groups.step(move_now=lambda d: None)
        world.hold.add(1)  # (no replacement yet: it is held)
        world.fail[(0, "checkpoint")] = _died("rank 0 hung")
        with pytest.raises(WorkerGroupFailure, match="rank 0 hung"):
            groups.checkpoint()
    finally:
        world.gate.set()
        groups.close()
    assert world.left() == (0, 0)


def test_a_replacement_that_comes_up_after_a_teardown_is_torn_down_not_adopted(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(replica_groups, "TEARDOWN_WAIT_SECONDS", 0.05)
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record))
    try:
        _lose_group_1_and_hold_its_replacement(groups, world)
        late = world.groups[-1]  # the replacement, held in its start
        groups.teardown()  # the machine restarts: a new generation
        assert ("warning: 1 replica group start(s) still running 0 s after the teardown; "
                "their groups are torn down when they return") in record.events
        world.hold.clear()
        _started(groups)
        assert groups.state.generation == 1
        world.gate.set()  # the old replacement comes up now, making its workers
        _settle_starts(groups)
        assert world.left() == (3, 3)
        groups.step(move_now=lambda d: None)
        assert late.teardowns == 2 and groups.members[1] is not late
        assert _kinds(groups) == {0: "Live", 1: "Live"} and groups.state.abandoned == ()
        assert world.left() == (2, 2)
        assert not any(e.startswith("replica group 1 replaced") for e in record.events)
    finally:
        world.gate.set()
        groups.close()
    assert world.left() == (0, 0)


def test_a_teardown_waits_for_a_start_in_flight_and_tears_down_what_it_made(tmp_path) -> None:
    """The replacement's start goes on past the teardown's kill (it makes its placement
    group and actors afterwards): the teardown waits for it and tears those down too."""
    world = World()
    groups = _started(_groups(tmp_path, world, standby=True))
    try:
        _settle_starts(groups, take=True)  # the standby is up
        assert isinstance(groups.state.standby, StandbyReady) and world.left() == (3, 3)
        groups.step(move_now=lambda d: None)
        world.hold_until_torn.add(1)
        world.fail[(1, "take_place")] = _died("cannot join")  # the standby fails: a new group
        world.fail[(1, "step")] = _died()
        groups.step(move_now=lambda d: None)
        assert isinstance(groups.state.slots[1], Starting)
        wait(starts(groups.state), timeout=10)  # the standby could not take the place
        groups.step(move_now=lambda d: None)  # a new group starts: held until torn down
        assert world.held.wait(10)
        fresh = groups.state.slots[1]
        assert isinstance(fresh, Starting) and not fresh.from_standby
        groups.teardown()
        assert fresh.group.made_after_teardown and fresh.group.teardowns == 2
        assert world.left() == (0, 0) and groups.state.abandoned == ()
    finally:
        groups.close()
    assert world.left() == (0, 0)


@pytest.mark.parametrize("lag", [0.0, 0.3], ids=["with-them", "after-them"])
def test_a_replacement_up_while_the_others_wait_in_a_quorum_joins_that_step(tmp_path,
                                                                           lag: float) -> None:
    """A replacement whose start returns while the others' step waits in a quorum (its
    torchft manager heartbeats, so the Lighthouse waits for it): its first call goes out
    then, into that quorum, and the step commits with it healed. Before, the replacement's
    first call went out only at the next step, which never came: the others' step waited
    out the quorum timeout (the standby, which takes its place within 0.1 s of the loss,
    met this every time). Its call may return after the others' (the heal, then the step):
    the step is still recorded healed (before, only the event said so)."""
    world, record = World(), FakeRecord()
    world.joiner_lags = lag
    groups = _started(_groups(tmp_path, world, record))
    try:
        _lose_group_1_and_hold_its_replacement(groups, world)
        world.quorum_waits = True
        started = time.monotonic()
        stats = groups.step(move_now=lambda d: None)
        assert time.monotonic() - started < 5
        assert stats.step == 3 and stats.healed and record.healed == [1]
        assert _kinds(groups) == {0: "Live", 1: "Live"}
    finally:
        world.gate.set()
        groups.close()
    assert world.left() == (0, 0)


def test_the_standby_replaces_a_lost_group(tmp_path) -> None:
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record, standby=True))
    try:
        _settle_starts(groups, take=True)
        assert "a standby group is up on n2, ready to replace a lost group" in record.events
        groups.step(move_now=lambda d: None)
        standby = groups.state.standby.group
        world.fail[(0, "poll")] = _died("node gone")
        groups.poll()
        assert groups.state.slots[0] == Starting(standby, groups.state.slots[0].call, 0,
                                                 groups.state.slots[0].since, from_standby=True)
        _settle_starts(groups)
        assert groups.step(move_now=lambda d: None).healed
        assert groups.members[0] is standby
        assert any(e.startswith("replica group 0 replaced by the standby group in ")
                   for e in record.events)
        _settle_starts(groups, take=True)  # a new standby after the adoption
        assert isinstance(groups.state.standby, StandbyReady) and world.left() == (3, 3)
    finally:
        groups.close()
    assert world.left() == (0, 0)


def test_a_failed_replacement_start_is_retried_after_its_wait(tmp_path) -> None:
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record))
    now = [1000.0]
    groups.clock = lambda: now[0]
    try:
        groups.step(move_now=lambda d: None)
        world.fail[(1, "start")] = _died("no room")
        world.fail[(1, "step")] = _died()
        groups.step(move_now=lambda d: None)
        _settle_starts(groups)
        groups.step(move_now=lambda d: None)
        assert groups.state.slots[1] == Lost("start failed", 1005.0)
        assert world.left() == (1, 1)
        groups.step(move_now=lambda d: None)
        assert isinstance(groups.state.slots[1], Lost)  # not before its time
        now[0] = 1005.0
        groups.step(move_now=lambda d: None)
        _settle_starts(groups)
        groups.step(move_now=lambda d: None)
        assert _kinds(groups) == {0: "Live", 1: "Live"}
    finally:
        groups.close()
    assert world.left() == (0, 0)


def test_losing_more_groups_than_max_failures_fails_the_job(tmp_path) -> None:
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record, count=3, max_failures=1))
    try:
        groups.step(move_now=lambda d: None)
        world.fail[(1, "step")] = _died()
        world.fail[(2, "step")] = _died()
        with pytest.raises(JobError, match=r"^replica groups lost 2 times, more than "
                                           r"cluster.max_failures: 1"):
            groups.step(move_now=lambda d: None)
        assert [index for index, _ in record.lost] in ([1, 2], [2, 1])
    finally:
        groups.close()
    assert world.left() == (0, 0)


def test_when_every_group_is_lost_the_failure_reaches_the_machine(tmp_path) -> None:
    world = World()
    job = _job(tmp_path)
    record = JobRecord(job, tmp_path / "run", metrics=None)
    groups = ReplicatedWorkerGroup(job, record, should_stop=lambda: False,
                                   make_group=world.make, live_nodes=lambda: NODES,
                                   lighthouse=FakeLighthouse())
    machine = JobMachine(job, groups, record, stop_requested=lambda: False)
    try:
        assert isinstance(machine.step(MachineStarting(plan=_plan(2))), Running)
        assert isinstance(machine.step(Running()), Running)
        world.fail[(0, "step")] = _died("rank 0 of group 0 died")
        world.fail[(1, "step")] = _died("rank 0 of group 1 died")
        state = machine.step(Running())
        assert isinstance(state, Recovering) and "died" in state.failure.detail
        assert len(record.status().replica_losses) == 1  # the first; the second escalated
        machine.step(state)  # the recovery tears everything down
        assert world.left() == (0, 0) and groups.state.slots == {}
    finally:
        groups.close()
    assert world.left() == (0, 0)


def test_a_start_still_running_when_the_job_closes_is_torn_down_when_it_returns(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(replica_groups, "TEARDOWN_WAIT_SECONDS", 0.05)
    world, record = World(), FakeRecord()
    groups = _started(_groups(tmp_path, world, record))
    try:
        _lose_group_1_and_hold_its_replacement(groups, world)
    finally:
        groups.close()
    (late,) = groups.state.abandoned
    assert any(e.startswith("warning: 1 replica group start(s) still running")
               for e in record.events)
    world.gate.set()  # it comes up after the job ended, making its workers
    deadline = time.monotonic() + 10  # (its callback runs just after its waiters wake)
    while late.group.teardowns < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late.group.teardowns == 2 and world.left() == (0, 0)
