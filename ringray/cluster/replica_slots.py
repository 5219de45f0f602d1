"""The replica groups' slots as a state machine (no Ray here): each replica group's place is
in one state at a time, and every change is a pure transition, tested without Ray.

    state = Replicas(rules=SlotRules(count=2, max_failures=3, standby_wanted=True))
    state, actions = reduce(state, GroupFailed(1, failure, during="step"), now)
    # actions: RecordLost(1, ...), TearDown(group) -- the caller does them, in order

:class:`~ringray.cluster.replica_groups.ReplicatedWorkerGroup` owns one :class:`Replicas` on
the controller's thread. Its pool threads only run the Ray calls (start a group, build it, step
it) and hand back a value or an exception through their futures; the controller's thread turns
each result into an event here and does the actions that come back. The group handles and the
futures are opaque to this module: it only keeps them in the state they belong to.

A slot is one of:

- :class:`Starting`: a group coming up (the job's start, or a replacement: new workers, or the
  standby joining), with the call in flight and the generation it started in;
- :class:`Joining`: a replacement built and training, not yet past the job's step (it heals
  from a live peer at its first step);
- :class:`Live`: a group holding the job's state, at the step it last committed;
- :class:`Lost`: a group torn down, its replacement due at ``retry_at`` (``inf``: never).

Besides the slots: the standby (:class:`StandbyStarting`, :class:`StandbyReady` or none), the
generation (teardowns so far), the losses counted against ``cluster.max_failures``, the
newest step the job recorded, and the starts a teardown abandoned, still to be torn down when
they return. Which events lead where, and what each asks of the caller, is the table in
docs/architecture.md (replica groups).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ringray.cluster.errors import StopRequested
from ringray.cluster.policy import Failure

# ----------------------------------------------------------------- slot states


@dataclass(frozen=True)
class Starting:
    """A group coming up: ``call`` (its start, then its build, for the job's own start) is in
    flight. ``replacement``: it replaces a lost group (else it is one of the job's start);
    ``from_standby``: the standby's workers, joining rather than starting."""

    group: Any
    call: Any
    generation: int
    since: float
    replacement: bool = True
    from_standby: bool = False


@dataclass(frozen=True)
class Joining:
    """A replacement built and training, not yet past the job's step. ``step``: the last step
    it committed (None before its first); ``call``: its step call in flight."""

    group: Any
    since: float
    step: int | None = None
    call: Any = None


@dataclass(frozen=True)
class Live:
    """A group holding the job's state, at ``step`` (its last committed step)."""

    group: Any
    step: int
    call: Any = None


@dataclass(frozen=True)
class Lost:
    """A group torn down; its replacement is due at ``retry_at`` (``inf``: never)."""

    reason: str
    retry_at: float


Slot = Starting | Joining | Live | Lost


@dataclass(frozen=True)
class StandbyStarting:
    """The standby's workers starting (``cluster.replica_standby``)."""

    group: Any
    call: Any
    generation: int
    since: float


@dataclass(frozen=True)
class StandbyReady:
    """The standby built ahead (workers, process group, trainer; no place among the groups
    yet): a replacement only takes the lost group's place and heals."""

    group: Any


Standby = StandbyStarting | StandbyReady


@dataclass(frozen=True)
class SlotRules:
    """What the transitions decide by: the job's replica groups, ``cluster.max_failures``,
    whether a standby is wanted, and how long a failed replacement start waits to retry."""

    count: int
    max_failures: int
    standby_wanted: bool
    retry_seconds: float = 5.0


@dataclass(frozen=True)
class Replicas:
    """Every slot, the standby and the counters: the whole state of the replica groups."""

    rules: SlotRules
    slots: Mapping[int, Slot] = field(default_factory=dict)
    standby: Standby | None = None
    generation: int = 0
    losses: int = 0
    job_step: int = 0
    abandoned: tuple[Starting | StandbyStarting, ...] = ()


# ----------------------------------------------------------------- events


@dataclass(frozen=True)
class StartSubmitted:
    """A start of slot ``index`` went out (``replacement`` False: one of the job's start)."""

    index: int
    group: Any
    call: Any
    replacement: bool = True
    from_standby: bool = False


@dataclass(frozen=True)
class CallSent:
    """Slot ``index``'s next call (a build, a step) went out."""

    index: int
    call: Any


@dataclass(frozen=True)
class Formed:
    """Every group of the job's start is built; ``steps``: the step each restored."""

    steps: Mapping[int, int]
    job_step: int


@dataclass(frozen=True)
class StepReturned:
    """Slot ``index``'s step call returned ``step`` (``committed``: the groups committed it)."""

    index: int
    step: int
    committed: bool


@dataclass(frozen=True)
class JobStepped:
    """The job recorded ``step``."""

    step: int


@dataclass(frozen=True)
class GroupFailed:
    """Slot ``index``'s group failed ``during`` a step, a checkpoint, the digest comparison,
    a poll or an evaluation; ``lighthouse_gone``: the quorum server no longer answers."""

    index: int
    failure: Failure
    during: str = "step"
    lighthouse_gone: bool = False


@dataclass(frozen=True)
class StartFinished:
    """A replacement start (``call``) returned: ``error`` None, or what it raised. ``note``:
    a warning it returned (its placement shares a failure domain)."""

    call: Any
    error: BaseException | None = None
    note: str | None = None


@dataclass(frozen=True)
class StandbySubmitted:
    group: Any
    call: Any


@dataclass(frozen=True)
class StandbyFinished:
    """The standby's start returned; ``message``: what to record (its nodes, or why none)."""

    call: Any
    error: BaseException | None = None
    message: str | None = None


@dataclass(frozen=True)
class StandbyDropped:
    """The standby cannot be used (a node of its is gone)."""


@dataclass(frozen=True)
class Due:
    """Time to start the replacements whose retry time has come."""


@dataclass(frozen=True)
class TornDown:
    """Every group goes (the machine's teardown): a new generation begins."""


Event = (StartSubmitted | CallSent | Formed | StepReturned | JobStepped | GroupFailed
         | StartFinished | StandbySubmitted | StandbyFinished | StandbyDropped | Due | TornDown)


# ----------------------------------------------------------------- actions


@dataclass(frozen=True)
class TearDown:
    """Tear ``group`` down (``close``: ask its workers to close their servers first)."""

    group: Any
    close: bool = False


@dataclass(frozen=True)
class Cancel:
    """Cancel ``call`` if it has not begun (a call already running is left to return)."""

    call: Any


@dataclass(frozen=True)
class Record:
    message: str


@dataclass(frozen=True)
class RecordLost:
    index: int
    reason: str
    detail: str
    left: int


@dataclass(frozen=True)
class Replace:
    """Start slot ``index``'s replacement (``from_standby``: the standby joins), then report
    it with :class:`StartSubmitted`."""

    index: int
    from_standby: bool


@dataclass(frozen=True)
class PrepareStandby:
    """Start the standby's workers, then report it with :class:`StandbySubmitted`."""


@dataclass(frozen=True)
class AwaitStarts:
    """Wait, with a bound, for the abandoned starts, then report each that returned."""


@dataclass(frozen=True)
class Escalate:
    """No other group holds the job's state: the failure goes to the machine (``message``,
    when set, is recorded first)."""

    message: str | None = None


@dataclass(frozen=True)
class GiveUp:
    """More groups lost than ``cluster.max_failures`` allows: the job fails."""

    message: str


Action = (TearDown | Cancel | Record | RecordLost | Replace | PrepareStandby | AwaitStarts
          | Escalate | GiveUp)


# ----------------------------------------------------------------- queries


def alive(state: Replicas) -> list[int]:
    """Slots whose group trains (live or joining), lowest index first."""
    return sorted(i for i, s in state.slots.items() if isinstance(s, Live | Joining))


def holders(state: Replicas) -> list[int]:
    """Slots whose group holds the job's state (live, not joining)."""
    return sorted(i for i, s in state.slots.items() if isinstance(s, Live))


def joining(state: Replicas) -> list[int]:
    return sorted(i for i, s in state.slots.items() if isinstance(s, Joining))


def current(state: Replicas) -> list[int]:
    """Training slots at the newest committed step, lowest index first."""
    steps = {i: state.slots[i].step for i in alive(state)}
    newest = max((s for s in steps.values() if s is not None), default=0)
    return [i for i, s in steps.items() if s == newest]


def calls(state: Replicas) -> dict[int, Any]:
    """Every training slot's call in flight, by slot."""
    return {i: state.slots[i].call for i in alive(state) if state.slots[i].call is not None}


def starts(state: Replicas) -> list[Any]:
    """Every start call in flight or unreported: replacements', the standby's, abandoned."""
    found = [s.call for s in state.slots.values() if isinstance(s, Starting)]
    if isinstance(state.standby, StandbyStarting):
        found.append(state.standby.call)
    return found + [entry.call for entry in state.abandoned]


# ----------------------------------------------------------------- transitions


def reduce(state: Replicas, event: Event, now: float) -> tuple[Replicas, tuple[Action, ...]]:
    """The next state and what the caller must do, in order."""
    return _HANDLERS[type(event)](state, event, now)


def _with(state: Replicas, index: int, slot: Slot) -> Replicas:
    return replace(state, slots={**state.slots, index: slot})


def _start_submitted(state: Replicas, event: StartSubmitted, now: float):
    slot = state.slots.get(event.index)
    if slot is not None and not isinstance(slot, Lost):
        raise ValueError(f"replica slot {event.index} is {type(slot).__name__}, not free")
    state = _with(state, event.index, Starting(
        group=event.group, call=event.call, generation=state.generation, since=now,
        replacement=event.replacement, from_standby=event.from_standby))
    if event.from_standby:
        state = replace(state, standby=None)
    return state, ()


def _call_sent(state: Replicas, event: CallSent, now: float):
    slot = state.slots.get(event.index)
    if not isinstance(slot, Starting | Joining | Live):
        return state, ()
    return _with(state, event.index, replace(slot, call=event.call)), ()


def _formed(state: Replicas, event: Formed, now: float):
    slots = dict(state.slots)
    for index, step in event.steps.items():
        slot = slots[index]
        slots[index] = Live(group=slot.group, step=step)
    state = replace(state, slots=slots, job_step=event.job_step)
    return state, _standby_wanted(state)


def _standby_wanted(state: Replicas) -> tuple[Action, ...]:
    return (PrepareStandby(),) if state.rules.standby_wanted and state.standby is None else ()


def _step_returned(state: Replicas, event: StepReturned, now: float):
    slot = state.slots.get(event.index)
    if isinstance(slot, Live):
        step = event.step if event.committed else slot.step
        return _with(state, event.index, Live(group=slot.group, step=step)), ()
    if isinstance(slot, Joining):
        if event.committed and event.step > state.job_step:  # caught up: holds the state
            return _with(state, event.index, Live(group=slot.group, step=event.step)), ()
        step = event.step if event.committed else slot.step
        return _with(state, event.index, Joining(group=slot.group, since=slot.since,
                                                 step=step)), ()
    return state, ()


def _job_stepped(state: Replicas, event: JobStepped, now: float):
    return replace(state, job_step=event.step), ()


_DURING = {"step": "", "checkpoint": "; during a checkpoint",
           "digest": "; while comparing state digests", "poll": "",
           "evaluate": "; during the passkey evaluation"}


def _group_failed(state: Replicas, event: GroupFailed, now: float):
    index, failure = event.index, event.failure
    slot = state.slots.get(index)
    if not isinstance(slot, Live | Joining):
        return state, ()  # already lost
    others = [i for i in holders(state) if i != index]
    if not others:  # the last group holding the job's state: the machine's checkpoint path
        rest = [i for i in alive(state) if i != index]
        message = None
        if rest:
            message = (f"replica group {index} was the last group holding the job's state "
                       f"(group {', '.join(map(str, rest))} had not healed yet): the job "
                       f"restarts from its checkpoint")
        return state, (Escalate(message),)
    if event.lighthouse_gone:
        return state, (Escalate("the torchft Lighthouse is gone: no group can form a quorum, "
                                "so the job restarts from its checkpoint"),)
    losses = state.losses + 1
    over = losses > state.rules.max_failures
    retry_at = math.inf if over else now
    state = replace(_with(state, index, Lost(reason=failure.kind.value, retry_at=retry_at)),
                    losses=losses)
    actions: list[Action] = [
        RecordLost(index, reason=failure.kind.value,
                   detail=failure.detail + _DURING.get(event.during, f"; during {event.during}"),
                   left=len(alive(state))),
        TearDown(slot.group),
    ]
    if over:
        actions.append(GiveUp(
            f"replica groups lost {losses} times, more than cluster.max_failures: "
            f"{state.rules.max_failures}; last: replica group {index}, {failure.detail}"))
    return state, tuple(actions)


def _take_abandoned(state: Replicas, call: Any):
    """``call``'s start, if a teardown abandoned it: dropped from the state and its group
    torn down (a start of an earlier generation is never adopted); else None."""
    for entry in state.abandoned:
        if entry.call is call:
            rest = tuple(e for e in state.abandoned if e is not entry)
            return replace(state, abandoned=rest), (TearDown(entry.group),)
    return None


def _start_finished(state: Replicas, event: StartFinished, now: float):
    if (taken := _take_abandoned(state, event.call)) is not None:
        return taken
    found = [(i, s) for i, s in state.slots.items()
             if isinstance(s, Starting) and s.call is event.call]
    if not found:
        return state, ()
    index, slot = found[0]
    if not slot.replacement:  # the job's own start: start() and build() wait for it
        return state, ()
    who = f"replica group {index}"
    notes = (Record(f"{who}: {event.note}"),) if event.note else ()
    if event.error is None:
        how = " by the standby group" if slot.from_standby else ""
        state = _with(state, index, Joining(group=slot.group, since=now))
        return state, (*notes, Record(
            f"{who} replaced{how} in {now - slot.since:.1f} s; it heals from a live peer at "
            f"its first step"), *_standby_wanted(state))
    if isinstance(event.error, StopRequested):  # the machine stops the job
        return (_with(state, index, Lost(reason="stopped", retry_at=math.inf)),
                (TearDown(slot.group),))
    if slot.from_standby:
        lost, message = Lost(reason="standby failed", retry_at=now), (
            f"{who}: the standby group could not join ({event.error}); starting a replacement")
    else:
        retry = state.rules.retry_seconds
        lost, message = Lost(reason="start failed", retry_at=now + retry), (
            f"{who}'s replacement did not start: {event.error}; trying again in {retry:.0f} s "
            f"(the others train on)")
    return _with(state, index, lost), (*notes, TearDown(slot.group), Record(message))


def _standby_submitted(state: Replicas, event: StandbySubmitted, now: float):
    if state.standby is not None:
        raise ValueError("a standby group is already there")
    return replace(state, standby=StandbyStarting(group=event.group, call=event.call,
                                                  generation=state.generation, since=now)), ()


def _standby_finished(state: Replicas, event: StandbyFinished, now: float):
    if (taken := _take_abandoned(state, event.call)) is not None:
        return taken
    standby = state.standby
    if not isinstance(standby, StandbyStarting) or standby.call is not event.call:
        return state, ()
    notes = (Record(event.message),) if event.message else ()
    if event.error is None:
        return replace(state, standby=StandbyReady(group=standby.group)), notes
    if not notes:
        notes = (Record(f"the standby group did not come up ({event.error}); a lost group's "
                        f"replacement starts workers of its own"),)
    return replace(state, standby=None), (TearDown(standby.group), *notes)


def _standby_dropped(state: Replicas, event: StandbyDropped, now: float):
    if not isinstance(state.standby, StandbyReady):
        return state, ()
    return replace(state, standby=None), (TearDown(state.standby.group),)


def _due(state: Replicas, event: Due, now: float):
    """Replacements whose time has come, while a group trains; while the standby is still
    starting they wait for it (it is then the first one's)."""
    if not alive(state) or isinstance(state.standby, StandbyStarting):
        return state, ()
    free = isinstance(state.standby, StandbyReady)
    actions = []
    for index in sorted(state.slots):
        slot = state.slots[index]
        if isinstance(slot, Lost) and slot.retry_at <= now:
            actions.append(Replace(index, from_standby=free))
            free = False
    return state, tuple(actions)


def _torn_down(state: Replicas, event: TornDown, now: float):
    """Every group is torn down: the live ones asked to close first, the starting ones where
    they are (and abandoned, to be torn down again when their calls return); their calls not
    yet begun are cancelled. A new generation: nothing of this one is adopted later."""
    actions: list[Action] = []
    abandoned = list(state.abandoned)
    for index in sorted(state.slots):
        slot = state.slots[index]
        if isinstance(slot, Live | Joining):
            actions.append(TearDown(slot.group, close=True))
            if slot.call is not None:
                actions.append(Cancel(slot.call))
        elif isinstance(slot, Starting):
            actions += [Cancel(slot.call), TearDown(slot.group)]
            abandoned.append(slot)
    if isinstance(state.standby, StandbyReady):
        actions.append(TearDown(state.standby.group))
    elif isinstance(state.standby, StandbyStarting):
        actions += [Cancel(state.standby.call), TearDown(state.standby.group)]
        abandoned.append(state.standby)
    if abandoned:
        actions.append(AwaitStarts())
    return replace(state, slots={}, standby=None, generation=state.generation + 1,
                   abandoned=tuple(abandoned)), tuple(actions)


_HANDLERS = {
    StartSubmitted: _start_submitted, CallSent: _call_sent, Formed: _formed,
    StepReturned: _step_returned, JobStepped: _job_stepped, GroupFailed: _group_failed,
    StartFinished: _start_finished, StandbySubmitted: _standby_submitted,
    StandbyFinished: _standby_finished, StandbyDropped: _standby_dropped, Due: _due,
    TornDown: _torn_down,
}
