"""Waiting on a job's workers, and turning whatever goes wrong into a :class:`Failure`.

    watch = WorkerWatch(poll_seconds=0.5, settle_seconds=120, log=record.event)
    watch.track(workers, nodes)                     # once the workers exist
    results = watch.wait([w.run_steps.remote(1) for w in workers], timeout=300,
                         what="a step", move_now=decide)
    # raises WorkerGroupFailure, JobError, CallTimeout (or StopRequested, with should_stop)

While a call is pending it polls the nodes that hold the workers (dead → ``node_died``) and,
when asked, whether they are draining. A failed call is classified by its cause: a worker
process that died, a node that died (the GCS may report the node's actors before its node
table says so, but it names the node in the actors' deaths), a dropped connection whose cause
is not known yet (waited for), a collective that timed out because a peer stopped (a hang),
or any other error in a step. Nothing is swallowed: a probe that fails in an unexpected way
is logged with its traceback.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)

from ringray.cluster.errors import CallTimeout, JobError, StopRequested, WorkerGroupFailure
from ringray.cluster.nodes import draining_nodes, node_liveness
from ringray.cluster.policy import Drain, Failure, FailureKind

# How long a probed worker may take to answer before it counts as silent.
PROBE_SECONDS = 2.0
# How Ray words an actor's death that its node's death caused (gcs_actor_manager).
_DEAD_NODE_IN_ACTOR_DEATH = re.compile(r"because its node has died\. Node Id: ([0-9a-f]+)")


def retry_cannot_help(error: BaseException) -> bool:
    """Whether a worker's error is deterministic: a ``ValueError`` (ringray's convention for
    bad options and input, a checkpoint of another model, a full disk), except the decoding
    errors that are ValueErrors only by inheritance: a ``UnicodeDecodeError`` or
    ``JSONDecodeError`` while reading can be a torn read that a retry does not meet."""
    return isinstance(error, ValueError) and not isinstance(
        error, UnicodeDecodeError | json.JSONDecodeError)


MoveNow = Callable[[Drain], str | None]  # why a drain leaves no time to checkpoint, or None
Log = Callable[..., None]  # log(message, exc=None)


class WorkerWatch:
    """The job's current workers (actor handles, in rank order) and their nodes."""

    def __init__(self, *, poll_seconds: float, settle_seconds: float,
                 log: Log) -> None:
        self.poll_seconds = poll_seconds
        self.settle_seconds = settle_seconds  # longest wait for a lost worker's cause
        self.log = log
        self.workers: list = []
        self.nodes: tuple[str, ...] = ()  # node of each rank; () when nothing runs
        self.drain: Drain | None = None  # a drain notice not yet acted on

    def track(self, workers: list, nodes: tuple[str, ...]) -> None:
        """Watch these workers, on these nodes (planned ones until the workers report)."""
        self.workers, self.nodes = workers, nodes

    def forget(self) -> None:
        self.workers, self.nodes = [], ()

    # ----------------------------------------------------------------- waiting
    def wait(self, refs: list, *, timeout: float, what: str = "workers to start",
             move_now: MoveNow | None = None,
             should_stop: Callable[[], bool] | None = None) -> list:
        """The results of ``refs`` (in order), watching the workers while waiting.

        Raises:
            WorkerGroupFailure: a worker died, its node died, or a call raised; with
                ``move_now``, a drain that leaves no time for a checkpoint.
            JobError: a call raised an error no retry can fix (:func:`retry_cannot_help`).
            CallTimeout: not every result within ``timeout`` seconds.
            StopRequested: ``should_stop`` turned true (the calls are abandoned).
        """
        deadline = time.monotonic() + timeout
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: dict = {}
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.poll_seconds)
            for ref in ready:
                if ref not in results:
                    results[ref] = self._result(ref, rank_of[ref])
            if not pending:
                return [results[ref] for ref in refs]
            if should_stop is not None and should_stop():
                raise StopRequested(f"stopped while waiting for {what}")
            self.check_nodes()
            if move_now is not None:
                self.check_drains(move_now)
            if time.monotonic() > deadline:
                late = [rank_of[ref] for ref in pending]
                raise CallTimeout(f"no answer from rank(s) {_ranks(late)} within "
                                  f"{timeout:.0f} s while waiting for {what}")

    def _result(self, ref, rank: int):
        try:
            return ray.get(ref)
        except ActorUnavailableError:
            raise WorkerGroupFailure(self._settle_lost_contact(rank)) from None
        except RayActorError as exc:
            raise WorkerGroupFailure(self._actor_death(rank, exc)) from None
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            if cause is not None and retry_cannot_help(cause):
                raise JobError(f"rank {rank}: {cause}") from None
            raise WorkerGroupFailure(self._step_error(rank, cause or exc)) from None

    def _step_error(self, rank: int, error: BaseException) -> Failure:
        """A call that raised. A collective broken by a dead or stopped peer lands here too;
        then the peer is the cause, and it is what gets reported."""
        time.sleep(self.poll_seconds)
        self.check_nodes()
        silent = self.silent_ranks(raise_for_dead=True)
        if silent:  # a peer stopped inside a step: the collective timed out waiting on it
            return Failure(kind=FailureKind.HANG,
                           detail=f"rank {rank}: {_first_line(error)}; rank(s) "
                           f"{_ranks(silent)} do not answer a health probe")
        return Failure(kind=FailureKind.WORKER_ERROR, detail=f"rank {rank}: {_first_line(error)}")

    # ----------------------------------------------------------------- causes
    def _actor_death(self, rank: int, exc: RayActorError) -> Failure:
        """A dead worker, counted under its cause."""
        self.check_nodes()
        node = _DEAD_NODE_IN_ACTOR_DEATH.search(str(exc))
        if node is not None:
            return Failure(kind=FailureKind.NODE_DIED, nodes=(node.group(1),),
                           detail=f"node(s) {node.group(1)[:8]} died, taking rank {rank}")
        return Failure(kind=FailureKind.ACTOR_DIED,
                       detail=f"rank {rank} died ({_death_reason(exc)})")

    def _settle_lost_contact(self, rank: int) -> Failure:
        """Why the connection to ``rank`` dropped. Ray cannot say yet: either the worker's
        process died (its raylet reports that within a moment) or its whole node did (seen
        once the GCS health checks give up on it). Wait until one of them is known, so the
        next placement leaves a dead node out and the restart is counted under its cause."""
        deadline = time.monotonic() + self.settle_seconds
        while time.monotonic() < deadline:
            self.check_nodes()  # raises for a dead node
            try:
                ray.get(self.workers[rank].health.remote(), timeout=self.poll_seconds)
            except ActorDiedError as exc:
                return self._actor_death(rank, exc)
            except (ActorUnavailableError, GetTimeoutError):
                continue
            return Failure(kind=FailureKind.WORKER_ERROR,
                           detail=f"rank {rank}: a call was lost (the worker still answers)")
        return Failure(kind=FailureKind.ACTOR_DIED,
                       detail=f"rank {rank} unreachable for {self.settle_seconds:.0f} s")

    def _ranks_by_node(self) -> dict[str, list[int]]:
        nodes: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            nodes.setdefault(node, []).append(rank)
        return nodes

    def check_nodes(self) -> None:
        """Raise ``node_died`` if a node holding a rank is dead."""
        alive = node_liveness()
        dead = {node: ranks for node, ranks in self._ranks_by_node().items()
                if not alive.get(node, False)}
        if dead:
            ranks = sorted(r for rs in dead.values() for r in rs)
            raise WorkerGroupFailure(Failure(
                kind=FailureKind.NODE_DIED, nodes=tuple(sorted(dead)),
                detail=f"node(s) {short_nodes(dead)} died, taking rank(s) {_ranks(ranks)}",
            ))

    def check_drains(self, move_now: MoveNow) -> None:
        """Note a drain of a node holding a rank (once) in :attr:`drain`; raise ``preempted``
        at once when ``move_now`` says there is no time to checkpoint first."""
        ours = self._ranks_by_node()
        draining = {node: deadline for node, deadline in draining_nodes().items()
                    if node in ours}
        if not draining or self.drain is not None:
            return
        deadlines = [d for d in draining.values() if d is not None]
        drain = Drain(nodes=tuple(sorted(draining)),
                      deadline_unix=min(deadlines) if deadlines else None)
        self.drain = drain
        left = drain.seconds_left(time.time())
        self.log(f"node(s) {short_nodes(draining)} draining"
                 + (f", {left:.0f} s to the deadline" if left is not None else ""))
        why = move_now(drain)
        if why is not None:
            self.drain = None
            raise WorkerGroupFailure(Failure(kind=FailureKind.PREEMPTED, nodes=drain.nodes,
                                      detail=f"node(s) {short_nodes(draining)} draining; {why}"))

    def silent_ranks(self, *, raise_for_dead: bool = False) -> list[int]:
        """Ranks that do not answer a health probe within :data:`PROBE_SECONDS`; with
        ``raise_for_dead``, a dead worker raises its failure instead of counting as silent."""
        probes = [w.health.remote() for w in self.workers]
        silent = []
        for rank, probe in enumerate(probes):
            try:
                ray.get(probe, timeout=PROBE_SECONDS)
            except ActorUnavailableError:
                if raise_for_dead:
                    raise WorkerGroupFailure(self._settle_lost_contact(rank)) from None
                silent.append(rank)
            except RayActorError as exc:
                if raise_for_dead:
                    raise WorkerGroupFailure(self._actor_death(rank, exc)) from None
                silent.append(rank)
            except Exception as exc:  # not a known death: say what it was
                self.log(f"rank {rank}: health probe failed: {_first_line(exc)}", exc=exc)
                silent.append(rank)
        return silent

    def describe_silence(self) -> str:
        """Which ranks still answer a health probe (for a hang's report)."""
        silent = self.silent_ranks()
        if not silent:
            return "every rank answers its health probe (stuck in a collective?)"
        return f"rank(s) {_ranks(silent)} do not answer a health probe"


def _death_reason(exc: RayActorError) -> str:
    """The line of an actor's death that says why (Ray puts it after the actor's details)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    because = [line for line in lines if "because" in line]
    return (because or lines or [type(exc).__name__])[0][:200]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def short_nodes(nodes) -> str:
    """Node ids, shortened for a log line."""
    return ", ".join(node[:8] for node in sorted(nodes))



def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
