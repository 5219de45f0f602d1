"""CheckpointStore on its own, in one process: the commit protocol (the marker, written last,
is the commit), lineages, pruning, refusing corrupt checkpoints, and failures a retry cannot
fix. The stores include an in-memory fsspec one whose ``mv`` is a copy and a delete and that
can die at any change it makes. (The multi-process crash and resume tests are in
``test_train_resume.py``; the service's in ``test_cluster_faults.py``.)"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from faulty_fs import Crash, CrashingMemoryFS, DenyingMemoryFS, FullMemoryFS
from torch.distributed.checkpoint import FileSystemReader
from train_cases import tiny_options

import ringray.train.checkpoint_catalog as checkpoint_module
from ringray.train import CheckpointStore, Trainer
from ringray.train.checkpoint import (
    COMPLETE_MARKER,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIOError,
    CheckpointWriteError,
    describe_error,
    is_deterministic,
)
from ringray.train.checkpoint_runs import LocationInUse, plan_run


def _state(value: float) -> dict:
    return {"weights": torch.full((3, 4), value), "step": int(value), "note": f"v{value}"}


def _first_verified(store: CheckpointStore, refs, *, refused) -> object:
    """The newest of ``refs`` that passes ``verify``, each refusal told to ``refused``: how a
    resume falls back (it then loads the one chosen)."""
    for ref in refs:
        try:
            store.verify(ref)
        except CheckpointCorrupt as exc:
            refused(exc)
            continue
        return ref
    return None


def _loaded(store: CheckpointStore, ref) -> dict:
    state = _state(0.0)
    store.load(ref, state)
    return state


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("scheme", ["path", "file-url", "memory"])
def test_save_then_load_round_trip(tmp_path: Path, scheme: str) -> None:
    """A local path and fsspec URLs (DCP's fsspec storage) store the same checkpoint; the
    marker records step, lineage and every file's size."""
    location = {"path": str(tmp_path / "ckpt"), "file-url": f"file://{tmp_path}/ckpt",
                "memory": f"memory://{tmp_path.name}/ckpt"}[scheme]
    store = CheckpointStore(location, lineage="run-a")
    ref = store.save(7, _state(7.0), keep=3, extra={"model_config": {"dim": 8}})
    assert (ref.step, ref.lineage) == (7, "run-a")
    assert ref.location.startswith(f"{location}/step_00000007-")
    marker = store.marker(ref)
    assert marker["step"] == 7 and marker["lineage"] == "run-a"
    assert marker["model_config"] == {"dim": 8}
    assert ".metadata" in marker["files"] and all(size > 0 for size in marker["files"].values())
    assert store.latest() == replace(ref, committed_unix=marker["committed_unix"])
    loaded = _loaded(store, store.latest())
    torch.testing.assert_close(loaded["weights"], torch.full((3, 4), 7.0))
    assert loaded["step"] == 7 and loaded["note"] == "v7.0"


def test_keeps_the_newest_k_of_its_own_lineage_only(tmp_path: Path) -> None:
    """Pruning deletes this lineage's older checkpoints; another run's are never touched."""
    other = CheckpointStore(str(tmp_path), lineage="other")
    other.save(50, _state(50.0), keep=1)
    store = CheckpointStore(str(tmp_path), lineage="mine")
    for step in (1, 2, 3, 4):
        store.save(step, _state(float(step)), keep=2)
    assert [r.step for r in store.of_lineage()] == [4, 3]
    assert [r.step for r in store.of_lineage("other")] == [50]
    assert len(_dirs(tmp_path)) == 3


def test_uncommitted_directories_are_never_loaded_and_are_cleaned_up(tmp_path: Path) -> None:
    """A directory without a marker is not a checkpoint: a crashed save (shards, no marker)
    and a legacy ``.partial``; the next commit removes them. (A marker that is there but
    unreadable is a damaged checkpoint, refused but kept: see below.)"""
    store = CheckpointStore(str(tmp_path), lineage="run")
    store.save(2, _state(2.0), keep=3)
    for name in ("step_00000009-deadbeef", "step_00000009.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"shard")
    assert [r.step for r in store.committed()] == [2]
    assert store.latest().step == 2
    store.save(3, _state(3.0), keep=3)
    assert [r.step for r in store.of_lineage()] == [3, 2] and len(_dirs(tmp_path)) == 2


def test_saving_a_step_again_replaces_it_only_after_the_new_copy_is_committed(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(str(tmp_path), lineage="run")
    first = store.save(4, _state(1.0), keep=3)
    second = store.save(4, _state(4.0), keep=3)
    assert first.location != second.location
    assert _loaded(store, store.latest())["note"] == "v4.0"
    assert [r.location for r in store.committed()] == [second.location]


def test_empty_or_missing_location_has_no_checkpoint(tmp_path: Path) -> None:
    assert CheckpointStore(str(tmp_path / "nowhere")).latest() is None
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path)).save(1, _state(1.0), keep=0)


# ------------------------------------------------------------------ crashes during a commit
def _crash_at_every_change(save_again_step: int) -> list[int]:
    """Commit step 1 (and step 2 when re-saving step 2), then save ``save_again_step`` with a
    crash at each change it makes in turn; after each crash a fresh store must load a
    committed checkpoint that verifies, with the contents of its step. Returns the steps
    found after each crash."""
    CrashingMemoryFS.reset()
    location = "crashmem://ck"

    def prepare() -> None:
        CrashingMemoryFS.reset()
        store = CheckpointStore(location, lineage="run")
        store.save(1, _state(1.0), keep=2)
        if save_again_step == 2:
            store.save(2, _state(2.0), keep=2)

    prepare()
    CrashingMemoryFS.arm(None)
    CheckpointStore(location, lineage="run").save(save_again_step, _state(20.0), keep=2)
    changes = CrashingMemoryFS.changes
    assert changes > 5, "the save makes several changes"
    found = []
    for budget in range(changes + 1):
        prepare()
        CrashingMemoryFS.arm(budget)
        # DCP reports a crash inside its own writes as a failed save; either way every later
        # change fails too, as nothing runs after a real crash.
        with pytest.raises((Crash, CheckpointIOError)):
            CheckpointStore(location, lineage="run").save(save_again_step, _state(20.0), keep=2)
            raise Crash("the save completed within the budget")  # the last budget, no crash
        CrashingMemoryFS.arm(None)
        store = CheckpointStore(location, lineage="run")
        ref = store.latest()
        assert ref is not None, f"crash at change {budget}: no checkpoint left"
        store.verify(ref)
        loaded = _loaded(store, ref)
        want = 20.0 if loaded["note"] == "v20.0" else float(ref.step)
        torch.testing.assert_close(loaded["weights"], torch.full((3, 4), want))
        found.append(ref.step)
    return found


def test_a_crash_at_any_point_of_a_commit_leaves_a_loadable_checkpoint() -> None:
    """On a store whose mv is a copy and a delete: a crash at each change of a save of step 2
    leaves step 1 (before the marker) or the new step 2 (after), never a broken one."""
    found = _crash_at_every_change(save_again_step=3)
    assert set(found) <= {1, 3} and found[0] == 1 and found[-1] == 3


def test_a_crash_while_saving_the_same_step_again_never_leaves_zero_copies() -> None:
    """Step 2 is committed; saving step 2 again crashes at each change in turn: a committed,
    verified step 2 (the old copy or the new one) is always there."""
    found = _crash_at_every_change(save_again_step=2)
    assert set(found) == {2}


# ------------------------------------------------------------------ corrupt checkpoints
def _two_checkpoints(tmp_path: Path) -> tuple[CheckpointStore, list]:
    store = CheckpointStore(str(tmp_path), lineage="run")
    refs = [store.save(step, _state(float(step)), keep=3) for step in (1, 2)]
    return store, refs


def test_a_truncated_shard_is_refused_naming_the_file(tmp_path: Path) -> None:
    store, (older, newer) = _two_checkpoints(tmp_path)
    shard = next(Path(newer.location).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointCorrupt) as info:
        store.load(newer, _state(0.0))
    message = str(info.value)
    assert "\n" not in message and shard.name in message and "truncated" in message
    refused = []
    assert _first_verified(store, tuple(store.of_lineage()), refused=refused.append) \
        .location == older.location
    assert len(refused) == 1 and refused[0].ref.location == newer.location
    assert _loaded(store, older)["note"] == "v1.0"


def test_a_deleted_metadata_file_is_refused_naming_it(tmp_path: Path) -> None:
    store, (older, newer) = _two_checkpoints(tmp_path)
    (Path(newer.location) / ".metadata").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"\.metadata is missing"):
        store.verify(newer)
    refused = []
    chosen = _first_verified(store, tuple(store.of_lineage()), refused=refused.append)
    assert chosen.location == older.location and len(refused) == 1


def _flip_64_bytes_inside(shard: Path) -> None:
    """XOR 64 bytes in the middle of ``shard``: the size stays, the content changes."""
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    shard.write_bytes(bytes(data))


def test_a_shard_changed_in_place_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Bytes changed inside a shard keep its size, so only its content checksum (crc32c,
    recorded in the marker at commit) tells: the load is refused in one line naming the file,
    and the previous checkpoint is chosen and loads its own weights."""
    store = CheckpointStore(str(tmp_path), lineage="run")
    big = {"weights": torch.full((256, 256), 1.0), "step": 1, "note": "v1.0"}
    older = store.save(1, big, keep=3)
    newer = store.save(2, {**big, "weights": torch.full((256, 256), 2.0), "note": "v2.0"},
                       keep=3)
    shard = next(Path(newer.location).glob("*.distcp"))
    _flip_64_bytes_inside(shard)
    loaded = {"weights": torch.zeros(256, 256), "step": 0, "note": ""}
    with pytest.raises(CheckpointCorrupt) as info:
        store.load(newer, loaded)
    message = str(info.value)
    assert "\n" not in message and shard.name in message and "checksum" in message
    refused = []
    chosen = _first_verified(store, tuple(store.of_lineage()), refused=refused.append)
    assert chosen.location == older.location
    assert [str(r) for r in refused] == [message]
    store.load(chosen, loaded)
    torch.testing.assert_close(loaded["weights"], torch.full((256, 256), 1.0), rtol=0, atol=0)
    assert set(store.marker(newer)["crc32c"]) == set(store.marker(newer)["files"])


def _format_2_checkpoint(tmp_path: Path):
    """A store with one checkpoint whose marker is rewritten as format 2 wrote it (sizes,
    no checksums)."""
    store = CheckpointStore(str(tmp_path), lineage="run")
    ref = store.save(1, _state(1.0), keep=3)
    marker_path = Path(ref.location) / COMPLETE_MARKER
    marker = json.loads(marker_path.read_text())
    del marker["crc32c"]
    marker_path.write_text(json.dumps({**marker, "format": 2}))
    return store, ref


def test_markers_without_checksums_still_load(tmp_path: Path) -> None:
    """Checkpoints committed before checksums (marker format 2: sizes only) still verify
    and load."""
    store, ref = _format_2_checkpoint(tmp_path)
    store.verify(ref)
    assert _loaded(store, ref)["note"] == "v1.0"


def test_a_format_3_marker_that_does_not_vouch_for_every_file_is_refused(tmp_path: Path) -> None:
    """Format 3 markers carry a CRC-32C per file. One whose checksums were deleted, or that
    leaves out a file of the checkpoint (DCP would read it), loaded unverified (issue 40);
    each is refused in one line naming the file."""
    store = CheckpointStore(str(tmp_path), lineage="run")
    ref = store.save(1, _state(1.0), keep=3)
    marker_path = Path(ref.location) / COMPLETE_MARKER
    marker = json.loads(marker_path.read_text())
    assert marker["format"] == 3
    first = sorted(marker["files"])[0]
    for damaged, pattern in (
            ({**marker, "crc32c": {}},
             rf"its commit marker has no checksum for {re.escape(first)} "),
            ({**marker, "files": {k: v for k, v in marker["files"].items() if k != first},
              "crc32c": {k: v for k, v in marker["crc32c"].items() if k != first}},
             rf"{re.escape(first)} is there but not in its commit marker")):
        marker_path.write_text(json.dumps(damaged))
        fresh = CheckpointStore(str(tmp_path), lineage="run")
        with pytest.raises(CheckpointCorrupt, match=rf"^checkpoint {re.escape(ref.location)}: "
                                                    rf"{pattern}"):
            fresh.verify(fresh.latest())


def test_a_damaged_marker_is_refused_with_its_reason_and_kept_until_superseded(
    tmp_path: Path,
) -> None:
    """The newest checkpoint's marker is there but unreadable (not a commit cut short: the
    marker is written whole). A resume tries it first and refuses it in one line naming the
    marker, then uses the previous one; the damaged one is not pruned by commits of earlier
    steps (a stop checkpoint at step 3), only once step 4 is committed again."""
    store = CheckpointStore(str(tmp_path), lineage="run")
    for step in (2, 4):
        store.save(step, _state(float(step)), keep=3)
    damaged = store.latest()
    (Path(damaged.location) / COMPLETE_MARKER).write_bytes(b"\x00\xff not json")

    plan = plan_run(CheckpointStore(str(tmp_path)), resume=True, move_aside=False)
    assert [r.step for r in plan.restore] == [4, 2] and plan.lineage == "run"
    refused = []
    chosen = _first_verified(store, plan.restore, refused=refused.append)
    assert chosen.step == 2 and len(refused) == 1
    assert "\n" not in str(refused[0]) and COMPLETE_MARKER in str(refused[0])
    assert Path(damaged.location).name in str(refused[0])

    resumed = CheckpointStore(str(tmp_path), lineage=plan.lineage)
    resumed.save(3, _state(3.0), keep=1)
    assert Path(damaged.location).exists(), "refused, and nothing newer committed yet"
    resumed.save(4, _state(4.0), keep=1)
    assert not Path(damaged.location).exists()
    assert [r.step for r in resumed.of_lineage()] == [4]


def test_a_new_run_does_not_overlook_a_damaged_checkpoint(tmp_path: Path) -> None:
    """A location whose only checkpoint has a damaged marker still holds a run: a new run
    (resume off) is refused rather than pruning it."""
    store = CheckpointStore(str(tmp_path), lineage="old")
    ref = store.save(6, _state(6.0), keep=3)
    (Path(ref.location) / COMPLETE_MARKER).write_text('{"step": 6, "lin')
    with pytest.raises(LocationInUse, match="up to step 6"):
        plan_run(CheckpointStore(str(tmp_path)), resume=False, move_aside=False)


# ------------------------------------------------------------------ failures a retry cannot fix
def test_a_full_disk_fails_once_naming_enospc_and_the_path_and_leaves_nothing() -> None:
    """ENOSPC while writing shards: one line naming ENOSPC and the file, the uncommitted
    directory removed, the previous checkpoint intact and loadable."""
    FullMemoryFS.reset(quota_bytes=1 << 20)
    store = CheckpointStore("fullmem://ck", lineage="run")
    store.save(1, _state(1.0), keep=3)
    FullMemoryFS.QUOTA_BYTES = FullMemoryFS()._used() + 600  # room for part of a save
    with pytest.raises(CheckpointWriteError) as info:
        store.save(2, {"weights": torch.zeros(64, 64)}, keep=3)
    message = str(info.value)
    assert "\n" not in message and "ENOSPC (No space left on device)" in message
    assert "/ck/step_00000002-" in message
    assert [r.step for r in store.committed()] == [1]
    assert [n for n in FullMemoryFS.store if "step_00000002" in n] == []
    assert _loaded(store, store.latest())["note"] == "v1.0"


@pytest.mark.parametrize(("code", "plain"), [
    (errno.EROFS, "is on a read-only file system"),
    (errno.EACCES, "is not writable (permission denied)"),
])
def test_a_read_only_or_unwritable_location_is_named_in_one_line(code: int, plain: str) -> None:
    """The store refuses to create a shard: one line naming checkpoint.path, what is wrong
    with it and the file, as an error no retry can fix."""
    DenyingMemoryFS.reset(code)
    store = CheckpointStore("denymem://ck", lineage="run")
    with pytest.raises(CheckpointWriteError) as info:
        store.save(1, _state(1.0), keep=3)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"checkpoint.path: denymem://ck {plain}")
    assert f"{errno.errorcode[code]} ({os.strerror(code)}): denymem://ck/step_00000001-" in message
    assert not isinstance(info.value, CheckpointIOError)


@pytest.mark.parametrize("other", [
    {"weights": torch.zeros(4, 4), "step": 0, "note": ""},  # another shape
    {"weights": torch.zeros(3, 4), "bias": torch.zeros(4), "step": 0, "note": ""},  # a new key
])
def test_tensors_that_do_not_fit_are_another_model_not_corruption(tmp_path: Path,
                                                                   other: dict) -> None:
    """DCP's own refusal (a shape, a key the checkpoint lacks) happens on every retry and
    says nothing against the files: a CheckpointError, not CheckpointCorrupt (which would
    make a resume fall back to an older checkpoint of the same model, refused the same way)."""
    store = CheckpointStore(str(tmp_path), lineage="run")
    ref = store.save(1, _state(1.0), keep=3)
    with pytest.raises(CheckpointError) as info:
        store.load(ref, other)
    assert not isinstance(info.value, CheckpointCorrupt)
    assert "belongs to another model" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("raised", [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),  # the device's
    RuntimeError("NCCL error: unhandled system error"),  # a collective's
    ValueError("I/O operation on closed file."),  # a stream's, raised by a library
    KeyError("a reworded DCP message"),  # a torch release that says it otherwise
])
def test_an_error_inside_dcp_load_after_the_checksums_passed_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: Exception) -> None:
    """The files passed their checksums and the checkpoint's metadata fits the state: an
    error inside dcp.load is the store's, the device's or a peer's, whatever it says, so it
    is a CheckpointIOError (retried), never CheckpointCorrupt (which would push the job
    back to an older checkpoint) and never a ValueError (never retried)."""
    store = CheckpointStore(str(tmp_path), lineage="run")
    ref = store.save(1, _state(1.0), keep=3)

    def read_data(self, plan, planner):
        raise raised

    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    with pytest.raises(CheckpointIOError, match="files passed their checksums") as info:
        store.load(ref, _state(0.0))
    assert not isinstance(info.value, ValueError)


def test_without_checksums_an_unreadable_checkpoint_is_still_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A format-2 marker vouches for sizes only: a failure inside dcp.load may be the bytes,
    so the restore falls back (CheckpointCorrupt), as before checksums."""
    store, ref = _format_2_checkpoint(tmp_path)

    def read_data(self, plan, planner):
        raise RuntimeError("unpickling stack underflow")

    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    with pytest.raises(CheckpointCorrupt, match="cannot be read: RuntimeError: unpickling"):
        store.load(ref, _state(0.0))


def test_a_stream_closed_under_the_checksum_read_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError from the stream while the checksums are read (a library's, not
    ringray's verdict on the bytes) is an I/O failure: CheckpointIOError, retried."""
    store = CheckpointStore(str(tmp_path), lineage="run")
    ref = store.save(1, _state(1.0), keep=3)

    def closed(stream):
        raise ValueError("I/O operation on closed file.")

    monkeypatch.setattr(checkpoint_module, "file_checksum", closed)
    with pytest.raises(CheckpointIOError, match="I/O operation on closed file"):
        store.load(ref, _state(0.0))


@pytest.mark.parametrize(("code", "deterministic"), [
    (errno.ENOSPC, True), (errno.EACCES, True), (errno.EROFS, True), (errno.EDQUOT, True),
    (errno.ECONNRESET, False), (errno.EIO, False),
])
def test_failures_that_a_retry_cannot_fix_are_told_apart(code: int, deterministic: bool) -> None:
    """Found below torch's serializer, which turns a failed write into a RuntimeError whose
    context is the OSError (as DCP reports a full disk)."""
    try:
        try:
            raise OSError(code, os.strerror(code), "/ck/step_00000002-abcd/__0_0.distcp")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None
    except RuntimeError as wrapped:
        wrapped.__context__ = wrapped.__context__ or OSError(code, os.strerror(code))
        assert is_deterministic(wrapped) is deterministic
        assert describe_error(wrapped).startswith(errno.errorcode[code])


def test_a_checkpoint_of_another_model_is_refused_before_any_tensor_is_read(
    tmp_path: Path,
) -> None:
    """A changed shape (n_layers) would make tensors not fit; the marker's model config is
    compared first, so the error names the field and both values, as a CheckpointError."""
    options = tiny_options(str(tmp_path))
    trainer = Trainer(options)
    trainer.step()
    store = CheckpointStore(options.checkpoint_location)
    ref = trainer.save_checkpoint(store)
    other = Trainer(replace(options, model=replace(options.model, n_layers=3)))
    with pytest.raises(CheckpointError) as info:
        other.load_checkpoint(store, ref)
    assert "n_layers: 2 in the checkpoint, 3 now" in str(info.value)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ lineages and run starts
def test_a_new_run_on_a_location_with_checkpoints_is_refused_or_moves_them_aside(
    tmp_path: Path,
) -> None:
    """resume: false where another run left checkpoints is refused in one line naming the
    location; with move_aside they go to <location>.previous-<time> and a new lineage starts.
    The new run's pruning never touches the old run's checkpoints, and a later resume picks
    the newest run."""
    location = str(tmp_path / "ck")
    old = CheckpointStore(location, lineage="old")
    for step in (10, 20):
        old.save(step, _state(float(step)), keep=5)

    with pytest.raises(LocationInUse) as info:
        plan_run(CheckpointStore(location), resume=False, move_aside=False)
    assert location in str(info.value) and "up to step 20" in str(info.value)

    plan = plan_run(CheckpointStore(location), resume=False, move_aside=True)
    assert plan.restore == () and plan.lineage != "old"
    assert plan.moved_aside_to.startswith(f"{location}.previous-")
    moved = CheckpointStore(plan.moved_aside_to)
    assert [r.step for r in moved.of_lineage("old")] == [20, 10]
    assert CheckpointStore(location).committed() == []

    new = CheckpointStore(location, lineage=plan.lineage)
    new.save(5, _state(5.0), keep=1)
    resumed = plan_run(CheckpointStore(location), resume=True, move_aside=False)
    assert resumed.lineage == plan.lineage and [r.step for r in resumed.restore] == [5]


def test_resume_picks_the_most_recently_committed_lineage(tmp_path: Path) -> None:
    """Two lineages at one location (checkpoints from before this version could mix): the
    newest commit decides, even when the other lineage has higher step numbers."""
    CheckpointStore(str(tmp_path), lineage="first").save(20, _state(20.0), keep=3)
    CheckpointStore(str(tmp_path), lineage="second").save(10, _state(10.0), keep=3)
    plan = plan_run(CheckpointStore(str(tmp_path)), resume=True, move_aside=False)
    assert plan.lineage == "second" and [r.step for r in plan.restore] == [10]
    assert json.loads((Path(plan.restore[0].location) / COMPLETE_MARKER).read_text())[
        "lineage"] == "second"
