"""The training session's pure parts and the run directory's writer: when a step is
checkpointed, a torn ``steps.jsonl`` line after a crash, and which worker errors no retry can
help (a decoding error while reading is not one of them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_cases import tiny_options

from ringray.cluster.job_options import ClusterOptions, JobOptions
from ringray.cluster.placement import NodeSnapshot, plan_placement
from ringray.cluster.record import JobRecord
from ringray.cluster.watch import retry_cannot_help
from ringray.metrics import MetricsOptions
from ringray.train.checkpoint import CheckpointCorrupt, CheckpointError, CheckpointRef
from ringray.train.run_dir import RunDirectory, StepsLog
from ringray.train.session import checkpoint_due


def test_a_step_is_checkpointed_at_each_interval_and_at_the_end(tmp_path: Path) -> None:
    options = tiny_options(str(tmp_path), train={"steps": 7}, checkpoint={"interval": 3})
    assert [s for s in range(1, 8) if checkpoint_due(s, options)] == [3, 6, 7]
    never = tiny_options(str(tmp_path), train={"steps": 7}, checkpoint={"interval": 0})
    assert [s for s in range(1, 8) if checkpoint_due(s, never)] == [7]


def _lines(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path: Path) -> None:
    """A crash mid-append leaves a torn last line; cutting the log back to the restored step
    drops it with one warning naming the file and line (it used to raise and fail the job)."""
    log = tmp_path / "steps.jsonl"
    log.write_text(_lines(1, 2, 3) + '{"step": 4, "lo')
    warnings = StepsLog(log).truncate(2)
    assert log.read_text() == _lines(1, 2)
    assert len(warnings) == 1 and f"{log}:4: dropped an unreadable line" in warnings[0]
    assert "\n" not in warnings[0]


@pytest.mark.parametrize("bad", ["not json at all", '{"loss": 1.0}', '{"step": "3"}', "\xff\xfe"])
def test_any_unreadable_line_is_dropped_not_fatal(tmp_path: Path, bad: str) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_text(_lines(1) + bad + "\n" + _lines(2))
    warnings = StepsLog(log).truncate(5)
    assert log.read_text() == _lines(1, 2)
    assert len(warnings) == 1 and ":2: dropped an unreadable line" in warnings[0]


def test_the_controller_records_the_torn_line_as_an_event(tmp_path: Path) -> None:
    """The Ray path cuts the same log through the same RunDirectory, and says so in
    events.jsonl instead of failing the job through the controller's catch-all."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "steps.jsonl").write_text(_lines(1, 2) + '{"st')
    job = JobOptions(name="j", train=tiny_options(str(run_dir), parallel={"cp": 1}),
                     cluster=ClusterOptions(),
                     metrics=MetricsOptions(port=None))
    record = JobRecord(job, run_dir, metrics=None)
    plan = plan_placement([NodeSnapshot(node_id="n", slots=1)], cp=1, dp_options=(1,))
    record.started(plan, step=2, restored=None)
    assert (run_dir / "steps.jsonl").read_text() == _lines(1, 2)
    assert any("dropped an unreadable line" in e.message for e in record.status().events)


def test_the_run_directory_is_locked_while_open(tmp_path: Path) -> None:
    run_dir = RunDirectory(tmp_path / "run", job="j")
    assert run_dir.open() is None
    assert run_dir.lock.holder().job == "j"
    run_dir.close()
    assert run_dir.lock.holder() is None


def test_decoding_errors_are_retried_and_bad_input_is_not() -> None:
    """``ValueError`` means "the same every time" (bad options, another model's checkpoint, a
    full disk); a JSON or UTF-8 decoding error is a ValueError only by inheritance and may be a
    torn read, so the service retries it."""
    ref = CheckpointRef(step=1, location="/ck/step_1", lineage="l")
    assert retry_cannot_help(ValueError("train.seq_len: 1004 cannot be split"))
    assert retry_cannot_help(CheckpointError("n_layers: 2 in the checkpoint, 3 now"))
    assert retry_cannot_help(CheckpointCorrupt("checkpoint /ck/step_1: crc mismatch", ref))
    try:
        json.loads('{"step": 1')
    except json.JSONDecodeError as exc:
        assert not retry_cannot_help(exc)
    try:
        b"\xff".decode()
    except UnicodeDecodeError as exc:
        assert not retry_cannot_help(exc)
    assert not retry_cannot_help(RuntimeError("Connection closed by peer"))
