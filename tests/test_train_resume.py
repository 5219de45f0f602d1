"""Checkpoints resume training exactly, survive a crash mid-save, and load at another DP degree.

Real gloo processes; each launch is a fresh set of processes, as a restarted job would be.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import RanksFailed, run_gloo_ranks
from train_cases import (
    changed,
    rank_crash_while_saving,
    rank_run_training,
    tiny_options,
    weights_from_checkpoint,
)

from ringray.train import CheckpointStore, run_training


def _exactly_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


def _steps_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def test_resume_reaches_the_uninterrupted_weights(tmp_path: Path) -> None:
    """Train 6 steps with a checkpoint every 3; a second run stops after step 4; a third
    resumes from the step-3 checkpoint and ends with weights identical (bit for bit) to the
    uninterrupted run's at step 6. CP=2, zigzag."""
    options = tiny_options("", parallel={"cp": 2}, train={"steps": 6}, checkpoint={"interval": 3})
    straight = replace(options, run_dir=str(tmp_path / "straight"))
    interrupted = replace(options, run_dir=str(tmp_path / "interrupted"))
    first = run_gloo_ranks(2, rank_run_training, [(straight, None), (interrupted, 4)])
    assert first[0][1]["last_step"] == 4
    assert [r.step for r in CheckpointStore(interrupted.checkpoint_location).committed()] == [3]

    resumed = run_gloo_ranks(2, rank_run_training, [(interrupted, None)])
    assert resumed[0][0]["resumed_from"] == 3
    _exactly_equal(resumed[0][0]["weights"], first[0][0]["weights"])
    _exactly_equal(resumed[1][0]["weights"], first[0][0]["weights"])

    # steps.jsonl describes the training that produced the weights: steps 1..6 once each,
    # with the resumed steps' losses equal to the uninterrupted run's.
    lines = _steps_log(tmp_path / "interrupted")
    straight_lines = _steps_log(tmp_path / "straight")
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert [x["loss"] for x in lines] == [x["loss"] for x in straight_lines]


def test_crash_between_shard_write_and_commit_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    """Rank 0 dies after every rank's step-5 shards are written, before it writes the commit
    marker: step 3 stays the newest committed checkpoint, the uncommitted directory is never
    loaded, and a restarted job resumes from step 3, finishes, and removes it."""
    options = tiny_options(str(tmp_path / "run"), parallel={"cp": 2}, train={"steps": 6})
    with pytest.raises(RanksFailed, match=r"ranks? \[0"):
        run_gloo_ranks(2, rank_crash_while_saving, options, timeout_seconds=300)

    root = Path(options.checkpoint_location)
    uncommitted = [d for d in root.glob("step_00000005-*")]
    assert len(uncommitted) == 1 and any(uncommitted[0].glob("*.distcp")), "shards written"
    store = CheckpointStore(options.checkpoint_location)
    assert [ref.step for ref in store.committed()] == [3]

    restarted = run_gloo_ranks(2, rank_run_training, [(options, None)])
    assert restarted[0][0]["resumed_from"] == 3
    assert [ref.step for ref in store.committed()] == [3, 6]
    assert not uncommitted[0].exists()


def test_dp2_checkpoint_continues_at_dp1(tmp_path: Path) -> None:
    """A checkpoint written by DP=2 (two processes) loads into DP=1 (this process) and
    training continues to the weights an uninterrupted DP=2 run reaches (1e-5)."""
    options = tiny_options("", parallel={"dp": 2, "cp": 1}, train={"steps": 5, "global_batch": 4},
                           checkpoint={"interval": 3})
    straight = replace(options, run_dir=str(tmp_path / "straight"))
    moved = replace(options, run_dir=str(tmp_path / "moved"))
    first = run_gloo_ranks(2, rank_run_training, [(straight, None), (moved, 3)])
    assert first[0][1]["last_step"] == 3

    result = run_training(changed(moved, parallel={"dp": 1}), log=lambda _: None)
    assert result.resumed_from == 3 and result.last_step == 5
    got = weights_from_checkpoint(changed(moved, parallel={"dp": 1}))
    for name, want in first[0][0]["weights"].items():
        torch.testing.assert_close(got[name], want, atol=1e-5, rtol=1e-5, msg=name)


def test_a_resume_with_other_data_settings_names_the_job_field(tmp_path: Path) -> None:
    """It said "seed: checkpoint has seed=0 but this loader has seed=5" before: neither the
    job's field (data.seed, not train.seed) nor a way out."""
    options = tiny_options(str(tmp_path / "run"), train={"steps": 2})
    run_gloo_ranks(1, rank_run_training, [(options, None)])
    longer = changed(options, train={"steps": 3})
    cases = [(changed(longer, data={"seed": 5}), "data.seed: the checkpoint was trained with 0, "
                                                  "this run has 5"),
             (changed(longer, train={"steps": 3, "global_batch": 4}),
              "train.global_batch: the checkpoint was trained with 2, this run has 4")]
    for other, message in cases:
        with pytest.raises(RanksFailed) as failed:
            run_gloo_ranks(1, rank_run_training, [(other, None)])
        assert message in str(failed.value), str(failed.value)[-2000:]
        assert "checkpoint.resume: false with checkpoint.move_aside: true" in str(failed.value)
