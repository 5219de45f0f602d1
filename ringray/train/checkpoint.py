"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), committed by a marker written
last, safe on any fsspec store (a local disk, s3://, gs://, memory://).

    store = CheckpointStore("runs/quickstart/checkpoints", lineage=run_id)   # or "s3://b/job"
    ref = store.save(step, state, keep=3, extra={"model_config": {...}})    # collective
    ref = store.latest()                # newest committed checkpoint of the newest lineage
    store.load(ref, state)              # verifies the files first, then fills ``state``

**The commit protocol.** A save writes its shards straight into the directory where they stay,
``step_00000042-<token>`` (the token makes every save's directory new, so saving a step again
never touches an earlier copy). Once every rank has written (each sends rank 0 the checksums
of its files), rank 0 lists the directory and writes ``ringray-complete.json``: the step, the
run's lineage, the world size, the model's config, and every file's size and CRC-32C
(:mod:`~ringray.train.checksums`, hashed while DCP writes). That marker, written last as one
object, is the commit (on a local disk it is written beside and renamed into place, so it is
whole or absent; the shards are never renamed: on object stores a rename is a copy and a
delete). A crash at any point before the marker leaves an uncommitted directory that nothing
loads; the previous checkpoint stays the newest committed one.

**Lineage.** Every run has a lineage id, written into its markers; a resumed run continues the
lineage of the checkpoint it resumed from (:func:`plan_run`). Pruning deletes only older
checkpoints of this lineage (keeping the newest ``keep``, and never the one just committed),
and an earlier copy of the same step only after its replacement is committed; it un-commits a
checkpoint (deletes its marker) before deleting its files, so a crash while pruning never
leaves a "committed" checkpoint with missing files.

**Refusing corrupt checkpoints.** :meth:`CheckpointStore.verify` compares the files with the
marker's sizes and checksums: a missing, truncated or changed file raises
:class:`CheckpointCorrupt` naming it, and the session's restore falls back to the previous
checkpoint; :meth:`CheckpointStore.load` does the same check first (each rank
hashing a share of the files). A marker that is there but unreadable is a damaged checkpoint:
a resume tries it, refuses it with the reason, and it is not pruned until a checkpoint of its
step or a later one commits. Markers of format 2 (sizes, no checksums) still load; a marker of
format 3 without a checksum for a file it lists, or leaving out a file of its checkpoint, is
refused (it could not vouch for what DCP would read).

**Errors.** A full disk, a permission or a read-only store while saving is a
:class:`CheckpointWriteError` (a ``ValueError``: never retried) whose one line names
``checkpoint.path``, the errno and the file. A peer that fails during a restore is a
:class:`CheckpointIOError` (retried; the files verified, so the checkpoint is not marked
corrupt); tensors that do not fit the model are a :class:`CheckpointError`. The taxonomy
is :mod:`~ringray.train.checkpoint_errors`.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import time
import uuid
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ringray.train.checkpoint_catalog import (
    CHECKPOINT_DIR,
    COMPLETE_MARKER,
    MARKER_FORMAT,
    CheckpointCatalog,
    dir_name,
    is_url,
    join_location,
    new_lineage,
)
from ringray.train.checkpoint_errors import (
    DETERMINISTIC_ERRNOS,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIOError,
    CheckpointWriteError,
    describe_error,
    deterministic_errno,
    is_communication_failure,
    is_deterministic,
    load_error,
    root_cause,
)
from ringray.train.checkpoint_ref import CheckpointRef
from ringray.train.checksums import ChecksummingFileSystem, FileChecksum, file_checksum
from ringray.train.collective import distributed, is_rank0, on_rank0

# The errors live in checkpoint_errors, the scan in checkpoint_catalog, the new-run check in
# checkpoint_runs; they are importable from here too.
__all__ = [
    "COMPLETE_MARKER", "DETERMINISTIC_ERRNOS", "CheckpointCatalog", "CheckpointCorrupt",
    "CheckpointError", "CheckpointIOError", "CheckpointRef", "CheckpointStore",
    "CheckpointWriteError", "describe_error", "deterministic_errno",
    "is_communication_failure", "is_deterministic", "new_lineage", "root_cause",
]


def _barrier() -> None:
    if distributed():
        dist.barrier()


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when torch.distributed is not initialised;
    here that is the intent (a 1-rank run), so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state_bytes(value: Any) -> int:
    """The bytes of the tensors in a (nested) state dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_state_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_state_bytes(v) for v in value)
    return 0


class CheckpointStore(CheckpointCatalog):
    """A :class:`~ringray.train.checkpoint_catalog.CheckpointCatalog` that saves, commits,
    prunes and loads; saves and pruning belong to ``lineage`` (a new one if not given)."""

    # ----------------------------------------------------------------- writing
    def check_shared(self) -> None:
        """Collective, before any training: raise :class:`CheckpointWriteError` on every rank
        (one line) unless rank 0 sees a file each rank writes at the location, i.e. the
        location is storage every rank shares (a node-local disk on a job of several nodes is
        not). Each rank's probe is removed; where there is no checkpoint yet, the location's
        directory is left as it was found. One process (no process group) checks nothing."""
        if not distributed() or dist.get_world_size() == 1:
            return
        rank, token = dist.get_rank(), new_lineage()
        try:
            existed = self._fs.exists(self._root)  # looked at before any rank writes
        except OSError:
            existed = True
        tokens: list = [None] * dist.get_world_size()
        dist.all_gather_object(tokens, token)  # one name per run, every rank the same
        probe = f"{self._root}/.shared-probe-{tokens[0]}-rank{rank}"
        try:
            self._fs.makedirs(self._root, exist_ok=True)
            self._fs.pipe(probe, b"ringray")
            wrote = True
        except OSError:  # unwritable: the first save names the error (and never retries it)
            wrote = False
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, wrote)  # also: every probe is written now
        if not all(everyone):
            if wrote:
                self._fs.rm(probe)
            return

        def missing() -> list[int]:
            return [r for r in range(dist.get_world_size())
                    if not self._fs.exists(f"{self._root}/.shared-probe-{tokens[0]}-rank{r}")]

        unseen = on_rank0(missing)  # every rank waits for rank 0's look before removing
        self._fs.rm(probe)
        dist.barrier()
        if not existed and rank == 0 and self._fs.exists(self._root) and \
                not self._fs.ls(self._root, detail=False):
            self._fs.rmdir(self._root)
        if unseen:
            raise CheckpointWriteError(
                f"checkpoint.path: {self.location} is not shared by every rank: rank 0 does not "
                f"see what rank(s) {', '.join(map(str, unseen))} wrote there; a job on several "
                f"nodes needs a location every node reads, such as a shared filesystem or an "
                f"object store URL (s3://, gs://)")

    def save(self, step: int, state: dict[str, Any], *, keep: int,
             extra: dict | None = None) -> CheckpointRef:
        """Write ``state`` as the checkpoint of ``step`` and commit it (collective: every rank
        calls it). ``extra`` goes into the marker (e.g. the model's config, readable before
        any tensor is loaded).

        Raises:
            CheckpointWriteError: a failure a retry cannot fix (ENOSPC, EACCES, EROFS ...),
                after removing the uncommitted directory; one line naming checkpoint.path.
            CheckpointIOError: any other failure of the write (also cleaned up).
        """
        if keep < 1:
            raise ValueError(f"keep: must be >= 1, got {keep}")
        name = f"step_{step:08d}-{uuid.uuid4().hex[:8]}"
        # Rank 0's own steps (the directory, the marker) end in a broadcast of how they went,
        # so a failure there raises on every rank instead of leaving the others in a barrier.
        name = self._on_coordinator(step, lambda: self._prepare(name))
        directory = join_location(self.location, name)
        writer = self._writer(directory)
        try:
            with _quiet_single_process():
                dcp.save(state, storage_writer=writer)
        except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
            # Rank 0 cleans up and says why, for every rank (they must agree on whether a
            # retry can help).
            probe_bytes = _state_bytes(state)
            why, code = on_rank0(functools.partial(self._diagnose, name, exc, probe_bytes))
            raise self._save_error(step, why, code) from None
        written = _gathered_on_rank0(writer.fs.written)  # also: every rank's shards are written
        self._on_coordinator(step, lambda: self._commit(name, step, extra or {}, written))
        if is_rank0():
            try:
                self._prune(name, keep)
            except Exception as exc:  # the new checkpoint is committed; old ones linger
                self.warnings.append(f"pruning {self.location} after step {step} failed: "
                                     f"{describe_error(exc)}")
        _barrier()
        return CheckpointRef(step=step, location=directory, lineage=self.lineage)

    def _diagnose(self, name: str, exc: BaseException,
                  state_bytes: int) -> tuple[str, int | None]:
        """Rank 0, after a failed write: remove its directory; the cause, and the errno of a
        failure no retry can fix (None: a retry may help). The writer's stream raises the
        ``OSError`` of a failed write itself (:mod:`~ringray.train.checksums`); for an error
        that still does not say, a probe write as large as the last checkpoint (or, at the
        first, this one's tensors) asks the store itself."""
        try:
            self._remove(name)
        except Exception as cleanup:  # reported with the cause, which matters more
            self.warnings.append(f"could not remove {name}: {describe_error(cleanup)}")
        code = deterministic_errno(exc)
        if code is not None:
            return describe_error(exc), code
        probe = f"{self._root}/.ringray-probe-{uuid.uuid4().hex[:8]}"
        try:
            self._fs.pipe(probe, bytes(self._probe_bytes(state_bytes)))
        except OSError as probe_error:
            code = deterministic_errno(probe_error)
            if code is not None:
                return f"{describe_error(probe_error)} (found by a probe write after " \
                       f"{describe_error(exc)})", code
        finally:
            try:
                if self._fs.exists(probe):
                    self._fs.rm(probe)
            except OSError:
                pass
        return describe_error(exc), None

    def _probe_bytes(self, state_bytes: int) -> int:
        """As many bytes as the newest committed checkpoint of this lineage holds, or else
        ``state_bytes`` (1 MiB to 64 MiB): what the failed save would have needed, about."""
        size = state_bytes
        newest = self.of_lineage()
        if newest:
            try:
                size = sum((self.marker(newest[0]).get("files") or {}).values()) or size
            except CheckpointCorrupt:
                pass
        return min(max(size, 1 << 20), 64 << 20)

    def _prepare(self, name: str) -> str:
        self._fs.makedirs(self._root, exist_ok=True)
        return name

    def _save_error(self, step: int, why: str, code: int | None) -> CheckpointError:
        """One line: for a failure no retry can fix (``code``, its errno), what it says about
        checkpoint.path and what to do; else the failure, to be retried."""
        if code is None:
            return CheckpointIOError(f"checkpoint of step {step} at {self.location} failed: {why}")
        plain, remedy = DETERMINISTIC_ERRNOS[code]
        return CheckpointWriteError(
            f"checkpoint.path: {self.location} {plain}: the checkpoint of step {step} was not "
            f"written ({why}); {remedy} or set checkpoint.path to another place")

    def _on_coordinator(self, step: int, work: Callable[[], Any]) -> Any:
        """Run ``work`` on rank 0 and give its result to every rank; if it raised, every rank
        raises the classified error."""
        def classified() -> Any:
            try:
                return work()
            except CheckpointWriteError:  # already says why, and that no retry helps
                raise
            except Exception as exc:
                raise self._save_error(step, describe_error(exc),
                                       deterministic_errno(exc)) from None

        return on_rank0(classified)

    def _commit(self, name: str, step: int, extra: dict,
                written: dict[str, FileChecksum]) -> None:
        """Rank 0: list the files and write the marker, last (on failure the directory is
        removed: an uncommitted save leaves nothing behind)."""
        try:
            self._write_marker(name, step, extra, written)
        except BaseException:
            self._remove(name)
            raise

    def _write_marker(self, name: str, step: int, extra: dict,
                      written: dict[str, FileChecksum]) -> None:
        """The marker lists every file with its size (as stored) and CRC-32C (as written,
        from ``written``; a file DCP did not write front to back is read back and hashed)."""
        path = f"{self._root}/{name}"
        files, checksums = {}, {}
        for relative, size in sorted(self._stored_sizes(path).items()):
            if not relative or relative.startswith(COMPLETE_MARKER):
                continue
            files[relative] = size
            checksum = written.get(relative)
            if checksum is None:
                with self._fs.open(f"{path}/{relative}", "rb") as f:
                    checksum = file_checksum(f)
            if checksum.size_bytes != size:  # the store kept something else than was written
                raise OSError(errno.EIO, f"{size} bytes stored, {checksum.size_bytes} written",
                              f"{path}/{relative}")
            checksums[relative] = checksum.crc32c
        unseen = sorted(set(written) - set(files))
        if unseen:  # written by other ranks somewhere rank 0 cannot see: not shared storage
            raise CheckpointWriteError(
                f"checkpoint.path: {self.location} is not shared by every rank: rank 0 does not "
                f"see {len(unseen)} file(s) the others wrote (e.g. {unseen[0]}); a job on "
                f"several nodes needs a location every node reads, such as a shared filesystem "
                f"or an object store URL (s3://, gs://)")
        marker = {
            "format": MARKER_FORMAT, "step": step, "lineage": self.lineage,
            "world_size": dist.get_world_size() if distributed() else 1,
            "committed_unix": time.time(), "files": files, "crc32c": checksums, **extra,
        }
        self._put_whole(f"{path}/{COMPLETE_MARKER}", json.dumps(marker).encode())

    def _put_whole(self, path: str, data: bytes) -> None:
        """Write ``data`` so that a crash leaves all of it or nothing: one object on a store
        (a single put), on a local disk a synced file beside it renamed into place."""
        if not isinstance(self._fs, LocalFileSystem):
            self._fs.pipe(path, data)
            return
        partial = f"{path}.partial"
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)

    def _remove(self, name: str) -> None:
        """Delete directory ``name``: its marker first (un-commit), then the rest."""
        path = f"{self._root}/{name}"
        try:
            if self._fs.exists(f"{path}/{COMPLETE_MARKER}"):
                self._fs.rm(f"{path}/{COMPLETE_MARKER}")
            if self._fs.exists(path):
                self._fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def _prune(self, just_committed: str, keep: int) -> None:
        """Rank 0, after a commit: keep this lineage's newest ``keep`` steps (one copy each, the
        latest commit) and delete its older checkpoints and every uncommitted directory left
        by a crashed save. A damaged checkpoint goes only once this commit's step reaches
        its step (until then it may be the one a person repairs). Other lineages' committed
        checkpoints are never touched."""
        committed, damaged = self._scan()
        ours = sorted((r for r in committed if r.lineage == self.lineage),
                      key=lambda r: (r.step, r.committed_unix), reverse=True)
        kept_steps: list[int] = []
        for ref in ours:
            name = dir_name(ref)
            if name == just_committed or (ref.step not in kept_steps and len(kept_steps) < keep):
                if ref.step not in kept_steps:
                    kept_steps.append(ref.step)
                continue
            self._remove(name)
        step = int(CHECKPOINT_DIR.match(just_committed).group(1))
        for ref in damaged:
            if ref.step <= step:
                self._remove(dir_name(ref))
        known = {dir_name(r) for r in committed + damaged}
        for name in self._entries():
            if CHECKPOINT_DIR.match(name) and name not in known and name != just_committed:
                self._remove(name)

    # ----------------------------------------------------------------- loading
    def load(self, ref: CheckpointRef, state: dict[str, Any]) -> None:
        """Fill ``state`` in place from ``ref`` (collective, as ``dcp.load`` is), after the
        checks of :meth:`verify`: each rank hashes a share of the files and every rank raises
        the same error. Verified files make a failure inside ``dcp.load`` something other
        than corruption, unless the marker has no checksums (format 2).

        Raises:
            CheckpointCorrupt: files missing, truncated or changed, or DCP cannot read them.
            CheckpointError: the tensors do not fit ``state`` (another model's checkpoint).
            CheckpointIOError: a failure that may pass (a dropped connection, a peer that
                died during the restore).
        """
        self._verify_on_every_rank(ref)
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=self._reader(ref.location))
        except (Exception, CheckpointException) as exc:
            verified = bool(self.marker(ref).get("crc32c"))  # format 3: checksums checked
            raise load_error(ref, exc, mismatch=self._mismatch(ref, state),
                             verified=verified) from None

    def _mismatch(self, ref: CheckpointRef, state: dict[str, Any]) -> str | None:
        """The evidence that ``ref`` holds another model's state, from its own metadata (DCP's
        ``.metadata``): the first entry of ``state`` it lacks, or holds with another shape or
        dtype (one line), else ``None``; ``None`` too when the metadata cannot be read (the
        files passed their checks, so that is no evidence)."""
        try:
            stored = self._reader(ref.location).read_metadata().state_dict_metadata
        except Exception:  # noqa: BLE001 - no evidence either way
            return None
        flat, _ = flatten_state_dict(state)
        for key, value in flat.items():
            meta = stored.get(key)
            if meta is None:
                return f"it has no {key}"
            if not isinstance(value, torch.Tensor):
                continue
            if not isinstance(meta, TensorStorageMetadata):
                return f"its {key} is not a tensor"
            if tuple(meta.size) != tuple(value.shape):
                return (f"its {key} has shape {list(meta.size)}, this run's "
                        f"{list(value.shape)}")
            if meta.properties.dtype != value.dtype:
                return f"its {key} is {meta.properties.dtype}, this run's {value.dtype}"
        return None

    def _writer(self, location: str) -> FileSystemWriter:
        """DCP's writer, with every file hashed as it is written."""
        writer = FsspecWriter(location) if is_url(location) else FileSystemWriter(location)
        writer.fs = ChecksummingFileSystem(writer.fs)
        return writer

    def _reader(self, location: str):
        return FsspecReader(location) if is_url(location) else FileSystemReader(location)


def _gathered_on_rank0(written: dict[str, FileChecksum]) -> dict[str, FileChecksum]:
    """Every rank's checksums, merged, on rank 0 ({} elsewhere): collective, and each rank
    sends only once its own files are written, so rank 0 has them all when it returns."""
    if not distributed():
        return dict(written)
    parts: list | None = [None] * dist.get_world_size() if is_rank0() else None
    dist.gather_object(written, parts, dst=0)
    merged: dict[str, FileChecksum] = {}
    for part in parts or []:
        merged.update(part)
    return merged
