"""CheckpointStore on its own, in one process: the commit protocol, pruning, fsspec URLs, and
refusing what it must not load. (The multi-process crash and resume tests are in
``test_train_resume.py``.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from train_cases import tiny_options

from ringray.train import CheckpointStore, Trainer
from ringray.train.checkpoint import COMPLETE_MARKER, CheckpointRef


def _state(value: float) -> dict:
    return {"weights": torch.full((3, 4), value), "step": int(value), "note": f"v{value}"}


@pytest.mark.parametrize("scheme", ["path", "file-url"])
def test_save_then_load_round_trip(tmp_path: Path, scheme: str) -> None:
    """A local path and an fsspec URL (DCP's fsspec storage) store the same checkpoint."""
    location = str(tmp_path / "ckpt") if scheme == "path" else f"file://{tmp_path}/ckpt"
    store = CheckpointStore(location)
    ref = store.save(7, _state(7.0), keep=3)
    assert ref == CheckpointRef(7, f"{location}/step_00000007")
    assert (tmp_path / "ckpt/step_00000007" / COMPLETE_MARKER).exists()
    assert json.loads((tmp_path / "ckpt/step_00000007" / COMPLETE_MARKER).read_text())["step"] == 7

    loaded = _state(0.0)
    store.load(store.latest(), loaded)
    torch.testing.assert_close(loaded["weights"], torch.full((3, 4), 7.0))
    assert loaded["step"] == 7 and loaded["note"] == "v7.0"


def test_keeps_the_newest_k_complete_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2, 3, 4):
        store.save(step, _state(float(step)), keep=2)
    assert [ref.step for ref in store.complete()] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_partial_and_unmarked_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    """Only a final name *and* the marker make a checkpoint complete."""
    store = CheckpointStore(str(tmp_path))
    store.save(2, _state(2.0), keep=3)
    store.save(5, _state(5.0), keep=3)
    # A crashed save of step 9 (shards, no commit) and a final name whose marker is missing.
    (tmp_path / "step_00000009.partial").mkdir()
    (tmp_path / "step_00000009.partial" / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / "step_00000005" / COMPLETE_MARKER).unlink()
    assert store.latest() == CheckpointRef(2, f"{tmp_path}/step_00000002")
    with pytest.raises(ValueError, match="not complete"):
        store.load(CheckpointRef(5, f"{tmp_path}/step_00000005"), _state(0.0))


def test_a_rerun_save_of_the_same_step_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    store.save(4, _state(1.0), keep=3)
    store.save(4, _state(4.0), keep=3)
    loaded = _state(0.0)
    store.load(store.latest(), loaded)
    assert loaded["note"] == "v4.0" and len(store.complete()) == 1


def test_empty_or_missing_location_has_no_checkpoint(tmp_path: Path) -> None:
    assert CheckpointStore(str(tmp_path / "nowhere")).latest() is None
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path)).save(1, _state(1.0), keep=0)


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    """Loading weights into a differently shaped model fails with the fields that differ."""
    options = tiny_options(str(tmp_path))
    trainer = Trainer(options)
    trainer.step()
    store = CheckpointStore(options.checkpoint_location)
    ref = trainer.save_checkpoint(store)
    other = Trainer(replace(options, model=replace(options.model, rope_theta=500_000.0)))
    with pytest.raises(ValueError, match=r"model: .*rope_theta"):
        other.load_checkpoint(store, ref)
