"""The controller's decisions as pure functions: failures, drains, elastic sizing; and the
small pure helpers around them (worker slots of a node, the cluster options' resources)."""

from __future__ import annotations

import pytest

from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.nodes import worker_slots
from ringray.cluster.policy import (
    CheckpointFirst,
    Failure,
    FailureKind,
    GiveUp,
    MoveNow,
    Recover,
    dp_options,
    grow_to,
    on_drain,
    on_failure,
    track_larger_capacity,
)
from ringray.metrics.catalog import RESTART_REASONS
from ringray.model import model_preset
from ringray.train import ParallelOptions, TrainOptions

NOT_FAULTS = (FailureKind.PREEMPTED,)


def test_every_failure_kind_is_a_restart_reason_of_the_metrics() -> None:
    """The metric catalog (below the service, so it cannot import FailureKind) spells the
    same reasons: a restart is never exported under a label the dashboards do not know."""
    assert {k.value for k in FailureKind} == set(RESTART_REASONS)


@pytest.mark.parametrize("kind", [k for k in FailureKind if k not in NOT_FAULTS])
def test_faults_are_recovered_until_max_failures_are_used(kind: FailureKind) -> None:
    """Each kind of fault is recovered while fewer than max_failures have been; the next
    one gives up, naming the fault and the budget."""
    failure = Failure(kind=kind, detail="rank 1 went away", nodes=("n1",))
    for used in range(3):
        decision = on_failure(failure, restarts=used, max_failures=3)
        assert decision == Recover(reason=kind, avoid_nodes=("n1",), counts_as_failure=True)
    decision = on_failure(failure, restarts=3, max_failures=3)
    assert isinstance(decision, GiveUp)
    assert kind.value in decision.reason and "rank 1 went away" in decision.reason
    assert "max_failures=3" in decision.reason


def test_preemptions_are_always_recovered_and_not_counted() -> None:
    failure = Failure(kind=FailureKind.PREEMPTED, detail="node drains", nodes=("n2",))
    decision = on_failure(failure, restarts=5, max_failures=0)
    assert decision == Recover(reason=FailureKind.PREEMPTED, avoid_nodes=("n2",),
                               counts_as_failure=False)


def test_zero_max_failures_fails_on_the_first_fault() -> None:
    failure = Failure(kind=FailureKind.HANG, detail="no step")
    assert isinstance(on_failure(failure, restarts=0, max_failures=0), GiveUp)


@pytest.mark.parametrize(
    ("seconds_left", "step", "checkpoint", "expected"),
    [
        (None, 5.0, 60.0, CheckpointFirst),  # no deadline: always time
        (30.0, 2.0, 5.0, CheckpointFirst),  # needs (2 + 5) * 1.5 = 10.5 s
        (10.5, 2.0, 5.0, CheckpointFirst),  # exactly enough
        (10.4, 2.0, 5.0, MoveNow),
        (1.0, None, None, CheckpointFirst),  # nothing measured yet: try
        (0.0, 0.5, None, MoveNow),
        (-3.0, None, None, MoveNow),  # the deadline has passed
    ],
)
def test_a_drain_checkpoints_first_only_when_the_deadline_leaves_time(
    seconds_left, step, checkpoint, expected
) -> None:
    decision = on_drain(seconds_left=seconds_left, step_seconds=step,
                        checkpoint_seconds=checkpoint)
    assert isinstance(decision, expected)
    if isinstance(decision, MoveNow):
        assert "s left before the drain deadline" in decision.why


@pytest.mark.parametrize(
    ("dp_min", "dp_max", "batch", "expected"),
    [
        (1, 4, 8, (4, 2, 1)),  # 3 does not divide 8
        (1, 4, 12, (4, 3, 2, 1)),
        (2, 2, 4, (2,)),
        (3, 5, 7, ()),
        (1, 1, 1, (1,)),
    ],
)
def test_dp_options_divide_the_batch_largest_first(dp_min, dp_max, batch, expected) -> None:
    assert dp_options(dp_min=dp_min, dp_max=dp_max, global_batch=batch) == expected


def test_larger_capacity_is_timed_from_its_first_sighting_and_reset_by_any_gap() -> None:
    since = track_larger_capacity(None, current_dp=1, feasible_dp=2, now=10.0)
    assert since == 10.0
    assert track_larger_capacity(since, current_dp=1, feasible_dp=2, now=15.0) == 10.0
    assert track_larger_capacity(since, current_dp=1, feasible_dp=1, now=16.0) is None
    assert track_larger_capacity(None, current_dp=2, feasible_dp=2, now=17.0) is None


def test_growth_waits_for_the_hysteresis_window() -> None:
    common = {"current_dp": 1, "feasible_dp": 2, "grow_after_seconds": 10.0}
    assert grow_to(larger_since=None, now=100.0, **common) is None
    assert grow_to(larger_since=95.0, now=100.0, **common) is None
    assert grow_to(larger_since=90.0, now=100.0, **common) == 2
    assert grow_to(larger_since=0.0, now=100.0, current_dp=2, feasible_dp=2,
                   grow_after_seconds=0.0) is None


def test_a_flickering_node_never_triggers_growth() -> None:
    """Capacity that comes and goes faster than the window: the timer restarts at every
    sighting after a gap, so no checkpoint boundary ever sees it old enough."""
    since = None
    grown = []
    for second in range(60):
        live = (second // 3) % 2 == 0  # 3 s present, 3 s gone
        since = track_larger_capacity(since, current_dp=1, feasible_dp=2 if live else 1,
                                      now=float(second))
        decision = grow_to(current_dp=1, feasible_dp=2 if live else 1, larger_since=since,
                           now=float(second), grow_after_seconds=5.0)
        if decision is not None:
            grown.append(second)
    assert grown == []


@pytest.mark.parametrize(
    ("total", "per_worker", "slots"),
    [
        ({"CPU": 8.0}, {"CPU": 1.0}, 8),
        ({"CPU": 16.0, "GPU": 8.0}, {"GPU": 1.0}, 8),
        ({"CPU": 16.0, "GPU": 8.0}, {"GPU": 1.0, "CPU": 4.0}, 4),  # CPUs are scarcer
        ({"CPU": 2.0}, {"GPU": 1.0}, 0),
        ({"CPU": 3.0}, {"CPU": 1.5}, 2),
        ({"CPU": 0.9999999999}, {"CPU": 0.3333333333}, 3),  # float rounding
        ({"CPU": 4.0}, {}, 0),
    ],
)
def test_worker_slots_are_set_by_the_scarcest_resource(total, per_worker, slots) -> None:
    assert worker_slots(total, per_worker) == slots


def test_actor_resources_split_cpus_gpus_and_custom_resources() -> None:
    train = TrainOptions(model=model_preset("debug"), parallel=ParallelOptions(cp=2))
    options = JobOptions(name="j", train=train, cluster=ClusterOptions(
        accelerator="gpu", worker_resources={"GPU": 1.0, "CPU": 4.0, "h100": 1.0}))
    assert options.actor_resources() == {"num_cpus": 4.0, "num_gpus": 1.0,
                                         "resources": {"h100": 1.0}}
    assert options.cluster.process_group_backend == "nccl"
    cpu = JobOptions(name="j", train=train)
    assert cpu.actor_resources() == {"num_cpus": 1.0, "num_gpus": 0, "resources": {}}
    assert cpu.cluster.process_group_backend == "gloo"
