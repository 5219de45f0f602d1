"""The controller's state machine, one transition at a time, with a fake worker group (no Ray).

For every state and every event a job meets (a stop, a worker's death, a node's death, a hang,
a drain notice, a failed checkpoint), the next state and what is recorded. Also the paths the
old controller got wrong: a preemption whose checkpoint fails is recovered without using a
fault, a drain deadline is absolute, a step already checkpointed is not saved again, a
deterministic checkpoint error is not retried, and a stop ends every state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from train_cases import tiny_options

from ringray.cluster.errors import JobError, StopRequested, WorkerGroupFailure
from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.machine import JobMachine
from ringray.cluster.placement import NodeSnapshot, PlacementError, plan_placement
from ringray.cluster.policy import Drain, Failure, FailureKind
from ringray.cluster.record import JobRecord
from ringray.cluster.states import (
    Checkpointing,
    Continue,
    Evaluate,
    Evaluating,
    Failed,
    Finished,
    MoveOff,
    Placing,
    Recovering,
    Resizing,
    Running,
    Starting,
    StopAfter,
    Stopped,
)
from ringray.metrics import MetricsOptions
from ringray.train import CheckpointRef, StepStats
from ringray.train.checkpoint_runs import RunPlan
from ringray.train.policy import steps_below_checkpoint
from ringray.train.session import Restored, Saved

EVENTS = ("stop", "worker_death", "node_death", "hang", "drain", "checkpoint_failure")


def _stats(step: int) -> StepStats:
    return StepStats(
        step=step, loss=2.5, grad_norm=0.75, learning_rate=1e-3, step_seconds=0.2,
        tokens=128, tokens_per_second=640.0, attention_compute_seconds=[0.1, 0.1],
        exposed_comm_seconds=[0.0, 0.0], overlap_ratio=1.0, load_imbalance=1.0, mfu=None,
        peak_memory_bytes=1, overlap_ratio_per_ring=[1.0], load_imbalance_per_ring=[1.0],
        ring_bytes_sent=[1, 1], peak_memory_bytes_per_rank=[1, 1],
    )


def _plan(dp: int = 1, cp: int = 2):
    nodes = [NodeSnapshot(node_id=f"node{i}", slots=cp) for i in range(dp)]
    return plan_placement(nodes, cp=cp, dp_options=(dp,))


@dataclass
class FakeWorkerGroup:
    """Does what the machine asks, instantly; ``fail[name]`` makes the next call raise."""

    fail: dict[str, BaseException] = field(default_factory=dict)
    drain: Drain | None = None
    capacity: bool = True
    feasible: int = 1
    step_count: int = 0
    saved: list[CheckpointRef] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    planned_for: list[tuple[int, ...]] = field(default_factory=list)  # dp choices per plan
    stop_during: str | None = None  # raise StopRequested from this call (an interrupted wait)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.stop_during == name:
            raise StopRequested(name)
        if name in self.fail:
            raise self.fail.pop(name)

    def plan(self, dp_choices, *, avoid):
        self._call("plan")
        self.planned_for.append(tuple(dp_choices))
        fitting = [dp for dp in dp_choices if dp <= self.feasible]
        if not self.capacity or not fitting:
            raise PlacementError("no node has 2 free slots")
        return _plan(dp=fitting[0])

    def ask_for_full_size(self) -> None:
        self.calls.append("ask")

    def start(self, plan) -> None:
        self._call("start")

    def run_plan(self, *, lineage):
        self._call("run_plan")
        return RunPlan(lineage=lineage or "run-1", restore=tuple(reversed(self.saved)))

    def build(self, options, run):
        self._call("build")
        restored = run.restore[0] if run.restore else None
        self.step_count = restored.step if restored else 0
        return Restored(step=self.step_count, checkpoint=restored)

    def step(self, *, move_now):
        self._call("step")
        if self.drain is not None and move_now(self.drain) is not None:
            self.drain = None
            raise WorkerGroupFailure(Failure(kind=FailureKind.PREEMPTED,
                                             detail="draining; no time"))
        self.step_count += 1
        return _stats(self.step_count)

    def checkpoint(self):
        self._call("checkpoint")
        ref = CheckpointRef(step=self.step_count, location=f"mem://ck/{self.step_count}",
                            lineage="run-1")
        self.saved.append(ref)
        return Saved(checkpoint=ref)

    def evaluate(self):
        self._call("evaluate")
        return None

    def evaluate_tasks(self, step: int):
        self._call("evaluate_tasks")
        cells = [{"task": "niah_single_1", "length": 1024, "score": 0.5, "samples": 2}]
        return {"results.json": json.dumps({"cells": cells, "skipped": [
                    "skipped ruler_vt at 1024: too short"], "model": {"step": step}}),
                "samples.jsonl": '{"task": "niah_single_1"}\n'}

    def poll(self) -> None:
        self._call("poll")

    def take_drain(self):
        drain, self.drain = self.drain, None
        return drain

    def feasible_dp(self, dp_choices, *, avoid) -> int:
        return self.feasible

    def teardown(self) -> None:
        self.calls.append("teardown")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Harness:
    machine: JobMachine
    workers: FakeWorkerGroup
    record: JobRecord
    stop: list[bool]
    clock: Clock
    run_dir: Path

    def events(self) -> list[str]:
        return [e.message for e in self.record.status().events]

    def logged(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]


def _harness(tmp_path: Path, *, steps: int = 6, interval: int = 2, dp: int = 1,
             dp_min: int | None = None, evaluate: bool | dict = False, **cluster) -> Harness:
    """``evaluate``: passkey at 256, or the ``eval`` section given."""
    evaluation = evaluate if isinstance(evaluate, dict) else \
        {"passkey_lengths": (256,)} if evaluate else {}
    train = tiny_options(str(tmp_path / "run"), parallel={"dp": dp, "cp": 2},
                         train={"steps": steps, "global_batch": 2},
                         checkpoint={"interval": interval}, eval=evaluation)
    job = JobOptions(name="job", train=train,
                     cluster=ClusterOptions(dp_min=dp_min, poll_seconds=0.5,
                                            capacity_wait_seconds=5, max_failures=2, **cluster),
                     metrics=MetricsOptions(port=None))
    workers, clock, stop = FakeWorkerGroup(), Clock(), [False]
    record = JobRecord(job, tmp_path / "run", metrics=None)
    machine = JobMachine(job, workers, record, stop_requested=lambda: stop[0], clock=clock,
                         wall_clock=clock, sleep=clock.sleep)
    return Harness(machine, workers, record, stop, clock, tmp_path / "run")


def _until(h: Harness, state, kind: type, limit: int = 200):
    """Step the machine until it reaches a state of ``kind`` (returns it)."""
    for _ in range(limit):
        if isinstance(state, kind):
            return state
        state = h.machine.step(state)
    raise AssertionError(f"never reached {kind.__name__}; at {state}")


def _running(h: Harness, *, after_steps: int = 0):
    state = _until(h, Placing(), Running)
    for _ in range(after_steps):
        state = h.machine.step(state)
        state = _until(h, state, Running)
    return state


# ------------------------------------------------------------------ the happy path
def test_a_job_runs_checkpoints_evaluates_and_finishes(tmp_path: Path) -> None:
    h = _harness(tmp_path, steps=4, interval=2, evaluate=True)
    seen = []
    state = Placing()
    while not state.terminal:
        seen.append(type(state).__name__)
        state = h.machine.step(state)
    assert isinstance(state, Finished)
    assert seen == ["Placing", "Starting", "Running", "Running", "Checkpointing", "Running",
                    "Running", "Checkpointing", "Evaluating"]
    assert [r.step for r in h.workers.saved] == [2, 4]
    steps = [json.loads(x)["step"] for x in (h.run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_the_evaluation_runs_passkey_then_the_tasks_and_keeps_their_files(
        tmp_path: Path) -> None:
    """eval.tasks after the final checkpoint: the workers' files under RUN/eval, the scores
    and skipped cells as events; tasks alone (no passkey lengths) evaluate too."""
    for passkey in ((256,), ()):
        h = _harness(tmp_path / str(len(passkey)), steps=2, interval=2, evaluate={
            "passkey_lengths": passkey, "tasks": ("niah_single_1",), "task_lengths": (1024,),
            "task_samples": 2})
        state = _until(h, Placing(), Finished)
        assert isinstance(state, Finished)
        evaluated = [c for c in h.workers.calls if c.startswith("evaluate")]
        assert evaluated == (["evaluate", "evaluate_tasks"] if passkey else ["evaluate_tasks"])
        results = json.loads((h.run_dir / "eval" / "results.json").read_text())
        assert results["model"] == {"step": 2}
        assert (h.run_dir / "eval" / "samples.jsonl").read_text() == '{"task": "niah_single_1"}\n'
        events = h.events()
        assert ("lm_eval tasks niah_single_1 at lengths [1024], 2 samples each, on step 2"
                in events)
        assert f"lm_eval tasks: niah_single_1 @ 1024: 50.0 (2 samples) ({h.run_dir / 'eval'})" \
            in events
        assert "skipped ruler_vt at 1024: too short" in events


def test_tasks_at_checkpoints_evaluate_after_each_interval_checkpoint(tmp_path: Path) -> None:
    """eval.tasks_at_checkpoints: after each interval checkpoint (step 2, 4) the tasks run
    and go to RUN/eval/step_<N>; after the final one (6) to RUN/eval, once; a stop during
    one abandons it with the step's checkpoint committed."""
    evaluation = {"tasks": ("niah_single_1",), "task_lengths": (1024,),
                  "tasks_at_checkpoints": True}
    h = _harness(tmp_path / "all", steps=6, interval=2, evaluate=evaluation)
    assert isinstance(_until(h, Placing(), Finished), Finished)
    steps = [json.loads(Path(d, "results.json").read_text())["model"]["step"]
             for d in sorted((h.run_dir / "eval").glob("step_*"))]
    assert steps == [2, 4]
    assert json.loads((h.run_dir / "eval" / "results.json").read_text())["model"]["step"] == 6
    assert h.workers.calls.count("evaluate_tasks") == 3

    h = _harness(tmp_path / "stop", steps=6, interval=2, evaluate=evaluation)
    h.workers.stop_during = "evaluate_tasks"
    stopped = _until(h, Placing(), Stopped)
    assert stopped.reason == ("stop requested during the task evaluation: abandoned (step 2's "
                              "checkpoint is committed)")
    assert "teardown" in h.workers.calls and h.workers.step_count == 2


# ------------------------------------------------------------------ every state × every event
def _event_in(h: Harness, event: str, *, call: str) -> None:
    """Arrange ``event`` to happen at the worker group's next ``call``."""
    if event == "stop":
        h.stop[0] = True
    elif event == "worker_death":
        h.workers.fail[call] = WorkerGroupFailure(Failure(kind=FailureKind.ACTOR_DIED,
                                                detail="rank 1 died"))
    elif event == "node_death":
        h.workers.fail[call] = WorkerGroupFailure(Failure(
            kind=FailureKind.NODE_DIED, nodes=("node0",), detail="node(s) node0 died"))
    elif event == "hang":
        h.workers.fail[call] = WorkerGroupFailure(Failure(kind=FailureKind.HANG,
                                                detail="no answer from rank(s) 1"))
    elif event == "drain":
        h.workers.drain = Drain(nodes=("node0",), deadline_unix=h.clock() + 600)
    elif event == "checkpoint_failure":
        h.workers.fail["checkpoint"] = WorkerGroupFailure(Failure(kind=FailureKind.WORKER_ERROR,
                                                        detail="rank 0: connection reset"))


# (state, event) -> the expected next state's type, and a word the record must hold
EXPECTED = {
    ("placing", "stop"): (Stopped, "stopped before the job was placed"),
    ("placing", "worker_death"): (Starting, None),  # no workers yet: placing goes on
    ("placing", "node_death"): (Starting, None),  # dead nodes are not offered to the plan
    ("placing", "hang"): (Starting, None),
    ("placing", "drain"): (Starting, None),  # a draining node is not offered either
    ("placing", "checkpoint_failure"): (Starting, None),
    ("starting", "stop"): (Stopped, "stopped while the workers started"),
    ("starting", "worker_death"): (Recovering, None),
    ("starting", "node_death"): (Recovering, None),
    ("starting", "hang"): (Recovering, None),
    ("starting", "drain"): (Running, None),  # noted, acted on by the first running step
    ("starting", "checkpoint_failure"): (Running, None),
    ("running", "stop"): (Checkpointing, None),
    ("running", "worker_death"): (Recovering, None),
    ("running", "node_death"): (Recovering, None),
    ("running", "hang"): (Recovering, None),
    ("running", "drain"): (Checkpointing, "checkpointing before moving"),
    ("running", "checkpoint_failure"): (Running, None),
    ("checkpointing", "stop"): (Checkpointing, None),  # then=StopAfter: saves, then stops
    ("checkpointing", "worker_death"): (Recovering, None),
    ("checkpointing", "node_death"): (Recovering, None),
    ("checkpointing", "hang"): (Recovering, None),
    ("checkpointing", "drain"): (Running, None),  # acted on at the next running step
    ("checkpointing", "checkpoint_failure"): (Recovering, None),
    ("evaluating", "stop"): (Stopped, "stop requested during the passkey evaluation"),
    ("evaluating", "worker_death"): (Recovering, None),
    ("evaluating", "node_death"): (Recovering, None),
    ("evaluating", "hang"): (Recovering, None),
    ("evaluating", "drain"): (Finished, None),  # training is done; nothing to move
    ("evaluating", "checkpoint_failure"): (Finished, None),
    ("recovering", "stop"): (Stopped, "stopped while recovering"),
    ("recovering", "worker_death"): (Placing, "actor_died"),
    ("recovering", "node_death"): (Placing, "node_died"),
    ("recovering", "hang"): (Placing, "hang"),
    ("recovering", "drain"): (Placing, "preempted"),
    ("recovering", "checkpoint_failure"): (Placing, "checkpoint_failed"),
    ("resizing", "stop"): (Stopped, "stopped while resizing"),
}


def _arrive(h: Harness, state_name: str):
    """The machine in ``state_name``, having run normally up to it."""
    if state_name == "placing":
        return Placing()
    if state_name == "starting":
        return h.machine.step(Placing())
    if state_name == "running":
        return _running(h)
    if state_name == "checkpointing":
        _running(h)
        return Checkpointing(then=Continue())
    if state_name == "evaluating":
        _running(h)
        return Evaluating()
    if state_name == "resizing":
        _running(h)
        return Resizing(to_dp=2)
    raise AssertionError(state_name)


CALL_OF = {"placing": "nothing: no workers yet", "starting": "start", "running": "step",
           "checkpointing": "checkpoint", "evaluating": "evaluate"}
RECOVERY_FAILURES = {
    "worker_death": Failure(kind=FailureKind.ACTOR_DIED, detail="rank 1 died"),
    "node_death": Failure(kind=FailureKind.NODE_DIED, nodes=("node0",), detail="node0 died"),
    "hang": Failure(kind=FailureKind.HANG, detail="no answer"),
    "drain": Failure(kind=FailureKind.PREEMPTED, nodes=("node0",), detail="draining"),
    "checkpoint_failure": Failure(kind=FailureKind.CHECKPOINT_FAILED, detail="io"),
}


@pytest.mark.parametrize(("state_name", "event"), list(EXPECTED),
                         ids=[f"{s}-{e}" for s, e in EXPECTED])
def test_every_state_meets_every_event(tmp_path: Path, state_name: str, event: str) -> None:
    want, recorded = EXPECTED[(state_name, event)]
    h = _harness(tmp_path, steps=6, interval=2, evaluate=True)
    if state_name == "recovering":
        state = Recovering(failure=RECOVERY_FAILURES.get(event, RECOVERY_FAILURES["hang"]))
        if event == "stop":
            _event_in(h, "stop", call="")
        nxt = h.machine.step(state)
    else:
        state = _arrive(h, state_name)
        _event_in(h, event, call=CALL_OF.get(state_name, ""))
        nxt = h.machine.step(state)
    assert isinstance(nxt, want), (state_name, event, nxt)
    if isinstance(nxt, Checkpointing) and event == "stop":
        assert nxt.then == StopAfter()
        assert isinstance(h.machine.step(nxt), Stopped)
        assert any("(checkpointed)" in message for message in h.events())
    if recorded is not None:
        assert any(recorded in message for message in h.events()), h.events()
    if isinstance(nxt, Stopped):
        assert h.workers.calls[-1] == "teardown"


def test_a_stop_while_running_checkpoints_then_stops(tmp_path: Path) -> None:
    h = _harness(tmp_path, steps=10, interval=4)
    state = _running(h, after_steps=1)
    h.stop[0] = True
    state = h.machine.step(state)
    assert state == Checkpointing(then=StopAfter())
    assert isinstance(h.machine.step(state), Stopped)
    assert [r.step for r in h.workers.saved] == [1]


def test_a_stop_right_after_a_checkpoint_does_not_save_the_step_again(tmp_path: Path) -> None:
    h = _harness(tmp_path, steps=10, interval=2)
    state = _until(h, Placing(), Checkpointing)
    state = h.machine.step(state)  # the interval checkpoint of step 2
    h.stop[0] = True
    stopped = h.machine.step(state)
    assert isinstance(stopped, Stopped) and "its checkpoint is committed" in stopped.reason
    assert [r.step for r in h.workers.saved] == [2]


def test_a_stop_during_a_wait_ends_the_start_and_the_evaluation_at_once(
    tmp_path: Path,
) -> None:
    """The ring's waits raise StopRequested when the job is stopping (e.g. a long passkey
    evaluation): the machine stops there, saying so."""
    h = _harness(tmp_path, steps=2, interval=2, evaluate=True)
    h.workers.stop_during = "evaluate"
    state = _until(h, Placing(), Evaluating)
    h.stop[0] = False  # the stop arrives while the evaluation runs
    stopped = h.machine.step(state)
    assert isinstance(stopped, Stopped) and "passkey evaluation" in stopped.reason
    h2 = _harness(tmp_path / "b", steps=2)
    h2.workers.stop_during = "build"
    assert isinstance(h2.machine.step(h2.machine.step(Placing())), Stopped)


def test_a_stop_while_waiting_for_capacity_stops_within_a_poll(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    h.workers.capacity = False
    state = h.machine.step(Placing())
    assert isinstance(state, Placing) and state.waiting_since == 1000.0
    assert "waiting for capacity: no node has 2 free slots" in h.events()
    h.stop[0] = True
    assert isinstance(h.machine.step(state), Stopped)
    assert h.clock.now == 1000.5  # one poll slept, not the whole capacity wait


def test_capacity_that_never_comes_fails_after_the_wait(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    h.workers.capacity = False
    state = _until(h, Placing(), Failed)
    assert "cluster.capacity_wait_seconds" in state.error


# ------------------------------------------------------------------ drains
def test_a_drain_with_time_checkpoints_then_moves_without_using_a_fault(tmp_path: Path) -> None:
    h = _harness(tmp_path, steps=10, interval=4)
    state = _running(h, after_steps=1)
    h.workers.drain = Drain(nodes=("node0",), deadline_unix=h.clock() + 600)
    state = h.machine.step(state)
    assert isinstance(state, Checkpointing) and isinstance(state.then, MoveOff)
    state = h.machine.step(state)
    assert isinstance(state, Recovering) and state.failure.kind is FailureKind.PREEMPTED
    assert isinstance(h.machine.step(state), Placing)
    assert h.machine.failures_used == 0 and [r.step for r in h.workers.saved] == [1]


def test_a_drain_whose_checkpoint_fails_moves_from_the_previous_one_without_a_fault(
    tmp_path: Path,
) -> None:
    """The old controller left a flag behind here and later failed the job on an assertion;
    now the failed checkpoint is recorded and the preemption's move goes on, uncounted, even
    when the failure is one a retry could not fix (the location unwritable)."""
    for error in (WorkerGroupFailure(Failure(kind=FailureKind.WORKER_ERROR, detail="rank 0: EIO")),
                  JobError("checkpoint of step 1 failed: EACCES (Permission denied)")):
        h = _harness(tmp_path / type(error).__name__, steps=10, interval=4)
        state = _running(h, after_steps=1)
        h.workers.drain = Drain(nodes=("node0",), deadline_unix=h.clock() + 600)
        state = h.machine.step(state)
        h.workers.fail["checkpoint"] = error
        state = h.machine.step(state)
        assert isinstance(state, Recovering)
        assert state.failure.kind is FailureKind.PREEMPTED
        assert "its checkpoint failed" in state.failure.detail
        state = h.machine.step(state)
        assert isinstance(state, Placing) and h.machine.failures_used == 0
        assert any("the checkpoint before moving failed" in m for m in h.events())
        # ... and the job goes on to the end, restoring the previous checkpoint (none: 0).
        state = _until(h, state, Running)
        assert h.machine.step_count == 0
        state = _until(h, state, Finished)


def test_a_drain_decision_uses_the_time_left_now(tmp_path: Path) -> None:
    """The deadline is absolute: a notice seen with 600 s left but acted on 599.9 s later
    (long steps) moves at once instead of checkpointing."""
    h = _harness(tmp_path, steps=10, interval=4)
    state = _running(h, after_steps=1)
    h.workers.drain = Drain(nodes=("node0",), deadline_unix=h.clock() + 600)
    h.clock.now += 599.9
    state = h.machine.step(state)
    assert isinstance(state, Recovering) and "before the drain deadline" in state.failure.detail


def test_a_drain_when_the_step_is_already_saved_moves_without_saving_again(
    tmp_path: Path,
) -> None:
    """The old controller checkpointed the same step twice here, deleting the committed copy
    first."""
    h = _harness(tmp_path, steps=10, interval=2)
    state = _until(h, Placing(), Checkpointing)
    state = h.machine.step(state)  # step 2 committed
    h.workers.drain = Drain(nodes=("node0",), deadline_unix=h.clock() + 600)
    state = h.machine.step(state)
    assert isinstance(state, Recovering) and [r.step for r in h.workers.saved] == [2]
    assert any("already checkpointed; moving" in m for m in h.events())


# ------------------------------------------------------------------ faults
def test_a_deterministic_checkpoint_error_fails_the_job_without_retries(tmp_path: Path) -> None:
    h = _harness(tmp_path, steps=10, interval=2)
    state = _until(h, Placing(), Checkpointing)
    h.workers.fail["checkpoint"] = JobError(
        "checkpoint of step 2 at /ck failed: ENOSPC (No space left on device)")
    state = h.machine.step(state)
    assert isinstance(state, Failed)
    assert "ENOSPC" in state.error and "will not succeed on a retry" in state.error
    assert h.workers.calls.count("checkpoint") == 1 and h.workers.calls[-1] == "teardown"


def test_faults_are_recovered_until_the_budget_is_used(tmp_path: Path) -> None:
    h = _harness(tmp_path, steps=50, interval=2)
    state = _running(h)
    for n in range(3):
        h.workers.fail["step"] = WorkerGroupFailure(Failure(kind=FailureKind.ACTOR_DIED,
                                                  detail=f"rank 1 died ({n})"))
        state = _until(h, state, Recovering)
        state = h.machine.step(state)
        if n < 2:
            assert isinstance(state, Placing)
            state = _until(h, state, Running)
    assert isinstance(state, Failed) and "max_failures=2 already used" in state.error
    restarts = h.record.status().restarts
    assert len(restarts) == 2 and all(r.reason == "actor_died" for r in restarts)


def test_a_recovery_restores_the_runs_newest_checkpoint_and_records_what_it_cost(
    tmp_path: Path,
) -> None:
    h = _harness(tmp_path, steps=20, interval=2)
    state = _running(h)
    while h.machine.step_count < 3:
        state = h.machine.step(state)
    h.workers.fail["step"] = WorkerGroupFailure(Failure(kind=FailureKind.NODE_DIED,
                                                        nodes=("node0",), detail="node0 died"))
    state = _until(h, h.machine.step(state), Running)
    assert h.machine.step_count == 2 and h.machine.avoid == frozenset({"node0"})
    state = h.machine.step(state)
    restart = h.record.status().restarts[0]
    assert (restart.failed_at_step, restart.resumed_from_step, restart.lost_steps) == (3, 2, 1)
    assert restart.recovery_seconds is not None
    steps = [json.loads(x)["step"] for x in (h.run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # cut back to 2, then step 3 again: each step once


def test_a_worker_value_error_fails_the_job_with_its_message(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    h.workers.fail["build"] = JobError("rank 0: model: checkpoint /ck was trained with a "
                                    "different model (n_layers: 2 in the checkpoint, 3 now)")
    state = h.machine.step(h.machine.step(Placing()))
    assert isinstance(state, Failed) and "n_layers: 2 in the checkpoint, 3 now" in state.error


def test_refused_checkpoints_are_recorded(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    original = h.workers.build

    def build(options, run):
        built = original(options, run)
        return Restored(step=built.step, checkpoint=built.checkpoint,
                        refused=("checkpoint /ck/step_4: .metadata is missing",))

    h.workers.build = build
    _running(h)
    assert ("refused checkpoint /ck/step_4: .metadata is missing; falling back to the "
            "previous checkpoint") in h.events()


def test_growing_happens_at_a_checkpoint_boundary_after_the_hysteresis(tmp_path: Path) -> None:
    h = _harness(tmp_path, steps=40, interval=2, dp=2, dp_min=1, grow_after_seconds=5)
    h.workers.feasible = 1
    state = _running(h)
    assert h.machine.plan.dp == 1
    h.workers.feasible = 2
    for _ in range(12):  # steps pass, polls see the capacity, 0.5 s of clock per poll
        h.clock.now += 1
        state = h.machine.step(state)
        if isinstance(state, Resizing):
            break
    assert state == Resizing(to_dp=2)
    state = h.machine.step(state)
    assert state == Placing(dp=2)
    state = _until(h, state, Running)
    assert h.workers.planned_for[-1] == (2,)  # placed for exactly the degree decided on
    assert h.machine.plan.dp == 2 and h.record.status().dp == 2
    assert h.record.status().resizes == 1


def test_a_grow_whose_capacity_vanished_places_the_largest_dp_that_fits(tmp_path: Path) -> None:
    """A resize to dp=2 whose capacity is gone by the time the group is placed again: the job
    says so and runs at the largest dp that still fits, rather than waiting for dp=2."""
    h = _harness(tmp_path, steps=40, interval=2, dp=2, dp_min=1, grow_after_seconds=5)
    h.workers.feasible = 1
    _running(h)
    state = _until(h, Placing(dp=2), Running)
    assert isinstance(state, Running)
    assert h.workers.planned_for[-2:] == [(2,), (2, 1)]
    assert h.machine.plan.dp == 1
    assert any(e.startswith("cannot place dp=2 any more") for e in h.events())


def test_errors_keep_their_traceback_in_the_events_file(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    try:
        raise OSError(5, "Input/output error")
    except OSError as exc:
        h.record.event("teardown failed: rank 1 could not be killed", exc=exc)
    entry = h.logged()[-1]
    assert entry["message"] == "teardown failed: rank 1 could not be killed"
    assert "OSError: [Errno 5] Input/output error" in entry["traceback"]


def test_what_follows_a_checkpoint_is_the_states_own(tmp_path: Path) -> None:
    """The same Checkpointing handler leads where its ``then`` says, so a transition never
    depends on a leftover flag: Continue → Running, Evaluate → Evaluating, StopAfter →
    Stopped, MoveOff(failure) → Recovering(that failure)."""
    failure = Failure(kind=FailureKind.PREEMPTED, detail="node draining")
    expected = {Continue(): Running(), Evaluate(): Evaluating(), MoveOff(failure):
                Recovering(failure=failure)}
    for then, next_state in expected.items():
        h = _harness(tmp_path / type(then).__name__)
        _running(h, after_steps=1)
        assert h.machine.step(Checkpointing(then=then)) == next_state
    h = _harness(tmp_path / "stop")
    _running(h, after_steps=1)
    state = h.machine.step(Checkpointing(then=StopAfter()))
    assert isinstance(state, Stopped) and "checkpointed" in state.reason


def test_a_restored_step_past_the_jobs_steps_fails_in_one_line(tmp_path: Path) -> None:
    """Resuming a run whose checkpoint is past train.steps would report 'finished at step
    40/30': the job fails at the start instead, naming the field and what would continue it."""
    h = _harness(tmp_path, steps=3)
    h.workers.saved.append(CheckpointRef(step=4, location="/ck/step_4", lineage="run-1"))
    state = _until(h, Placing(), Failed)
    assert state.error == steps_below_checkpoint(h.machine.job.train, h.workers.saved[-1])
    assert state.error.startswith("train.steps: 3 is below step 4 of the checkpoint this run "
                                  "resumes (/ck/step_4)")
    assert "step" not in h.workers.calls


def test_held_events_are_written_only_once_the_run_directory_is_taken(tmp_path: Path) -> None:
    """A controller refused its run directory (another live run holds it) must not write into
    that run's events.jsonl; once it holds the directory, what it held is written."""
    import os
    import socket

    from ringray.train.run_lock import LOCK_NAME, RunDirInUse

    h = _harness(tmp_path)
    h.record.hold_events()
    h.record.event("metrics: http://x")
    lock = h.run_dir / LOCK_NAME  # another live run's (this test's parent process)
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                "job": "other", "since_unix": 0}))
    with pytest.raises(RunDirInUse):
        h.record.open_run_dir()
    lock.unlink()
    assert not (h.run_dir / "events.jsonl").exists()
    assert [e.message for e in h.record.status().events] == ["metrics: http://x"]
    assert h.record.open_run_dir() is None
    assert [e["message"] for e in h.logged()] == ["metrics: http://x"]
    h.record.run_dir.close()
