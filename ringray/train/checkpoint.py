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
import re
import time
import uuid
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
from ringray.train.checkpoint_ref import LEGACY_LINEAGE, CheckpointRef
from ringray.train.checksums import ChecksummingFileSystem, FileChecksum, file_checksum
from ringray.train.collective import distributed, is_rank0, on_rank0
from ringray.train.policy import model_config_differences

COMPLETE_MARKER = "ringray-complete.json"
MARKER_FORMAT = 3  # 3: "crc32c" per file; 2: sizes only ("files"); 1: no lineage
UNKNOWN_LINEAGE = "unknown"  # a damaged checkpoint's: its marker cannot be read
_DIR = re.compile(r"^step_(\d{8})(?:-([0-9a-f]{8}))?(\.partial)?$")
# The errors live in checkpoint_errors; they are importable from here too.
__all__ = [
    "COMPLETE_MARKER", "DETERMINISTIC_ERRNOS", "CheckpointCorrupt", "CheckpointError",
    "CheckpointIOError", "CheckpointRef", "CheckpointStore", "CheckpointWriteError",
    "LocationInUse", "RunPlan", "check_new_run", "describe_error", "deterministic_errno",
    "is_communication_failure", "is_deterministic", "new_lineage", "plan_run",
    "root_cause",
]


class LocationInUse(ValueError):
    """``checkpoint.resume`` is off but the location already holds another run's checkpoints."""


def _is_url(location: str) -> bool:
    return "://" in location


def _join(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}"


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


def new_lineage() -> str:
    """A new run's lineage id."""
    return uuid.uuid4().hex[:12]


def _state_bytes(value: Any) -> int:
    """The bytes of the tensors in a (nested) state dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_state_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_state_bytes(v) for v in value)
    return 0


class CheckpointStore:
    """The checkpoints under ``location`` (a path or an fsspec URL); saves and pruning belong to
    ``lineage`` (a new one if not given)."""

    def __init__(self, location: str, *, lineage: str | None = None) -> None:
        self.location = location.rstrip("/") or location
        self.lineage = lineage or new_lineage()
        self._fs, self._root = fsspec.core.url_to_fs(self.location)
        self.warnings: list[str] = []  # what went wrong but did not fail a save (for the log)
        # Checkpoints this process has hashed in full (verify): load does not hash them again.
        self._content_verified: set[str] = set()

    # ----------------------------------------------------------------- reading
    def _entries(self) -> list[str]:
        """Names directly under the location ([] when it does not exist)."""
        try:
            if not self._fs.exists(self._root):
                return []
            listing = self._fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in listing]

    def _read_marker(self, name: str) -> tuple[dict | None, str | None]:
        """The marker of directory ``name``: ``(marker, None)``; ``(None, None)`` when it has
        none (not committed); ``(None, why)`` when it is there but unreadable. Markers are
        written whole (:meth:`_write_marker`), so an unreadable one was damaged after its
        commit: the checkpoint is refused with ``why``, not mistaken for a crashed save."""
        path = f"{self._root}/{name}/{COMPLETE_MARKER}"
        try:
            with self._fs.open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None, None
        try:
            marker = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
            return None, "it names no step"
        return marker, None

    def _scan(self) -> tuple[list[CheckpointRef], list[CheckpointRef]]:
        """The committed checkpoints (any lineage) and the damaged ones (a marker there but
        unreadable: lineage unknown, step from the directory's name), each oldest first."""
        committed, damaged = [], []
        for name in self._entries():
            match = _DIR.match(name)
            if not match or match.group(3):  # not a checkpoint, or a legacy .partial
                continue
            marker, damage = self._read_marker(name)
            location = _join(self.location, name)
            if marker is not None:
                committed.append(CheckpointRef(
                    step=int(marker["step"]), location=location,
                    lineage=str(marker.get("lineage", LEGACY_LINEAGE)),
                    committed_unix=float(marker.get("committed_unix", 0.0)),
                ))
            elif damage is not None:
                damaged.append(CheckpointRef(
                    step=int(match.group(1)), location=location, lineage=UNKNOWN_LINEAGE,
                    committed_unix=self._modified_unix(f"{self._root}/{name}/{COMPLETE_MARKER}"),
                ))
        return sorted(committed, key=_by_commit), sorted(damaged, key=_by_commit)

    def _modified_unix(self, path: str) -> float:
        try:
            modified = self._fs.info(path).get("mtime")
        except OSError:
            return 0.0
        return float(modified) if isinstance(modified, int | float) else 0.0

    def committed(self) -> list[CheckpointRef]:
        """Every committed checkpoint at the location (any lineage), oldest commit first."""
        return self._scan()[0]

    def damaged(self) -> list[CheckpointRef]:
        """Every checkpoint whose marker is there but unreadable, oldest first. Their lineage
        cannot be read (``UNKNOWN_LINEAGE``); a resume tries them (:meth:`restore_order`) so
        that each is refused with its reason, and pruning keeps them until a checkpoint of
        their step or a later one commits."""
        return self._scan()[1]

    def restore_order(self, lineage: str | None = None) -> list[CheckpointRef]:
        """What a resume of ``lineage`` (default: this store's) tries, newest step first: its
        committed checkpoints and every damaged one (refused, with the reason, when tried)."""
        lineage = lineage or self.lineage
        committed, damaged = self._scan()
        refs = [r for r in committed if r.lineage == lineage] + damaged
        return sorted(refs, key=lambda r: (r.step, r.committed_unix), reverse=True)

    def newest_lineage(self) -> str | None:
        """The lineage of the most recently committed checkpoint (the run to resume)."""
        refs = self.committed()
        return refs[-1].lineage if refs else None

    def of_lineage(self, lineage: str | None = None) -> list[CheckpointRef]:
        """The committed checkpoints of ``lineage`` (default: this store's), newest first: by
        step, and for a step saved twice the later commit first."""
        lineage = lineage or self.lineage
        refs = [r for r in self.committed() if r.lineage == lineage]
        return sorted(refs, key=lambda r: (r.step, r.committed_unix), reverse=True)

    def latest(self, lineage: str | None = None) -> CheckpointRef | None:
        """The newest committed checkpoint of ``lineage`` (default: the newest lineage at the
        location), or ``None``. Not verified: see :meth:`verify`."""
        lineage = lineage or self.newest_lineage()
        if lineage is None:
            return None
        refs = self.of_lineage(lineage)
        return refs[0] if refs else None

    def marker(self, ref: CheckpointRef) -> dict:
        """The commit marker of ``ref`` (raises :class:`CheckpointCorrupt` if unreadable)."""
        name = ref.location.rstrip("/").rsplit("/", 1)[-1]
        marker, damage = self._read_marker(name)
        if marker is None:
            what = f"is unreadable ({damage})" if damage else "is missing"
            raise CheckpointCorrupt(f"checkpoint {ref.location}: its marker {COMPLETE_MARKER} "
                                    f"{what}", ref)
        return marker

    def verify(self, ref: CheckpointRef) -> None:
        """Raise :class:`CheckpointCorrupt` (one line naming the file) unless every file the
        marker lists is there with its recorded size and checksum (this process reads them
        all). Markers of format 2 have sizes only; of format 1, neither: DCP's ``.metadata``
        must be there."""
        problem = self._problem(ref, share=(0, 1))
        if problem is not None:
            raise CheckpointCorrupt(problem, ref)
        self._content_verified.add(ref.location)

    def _problem(self, ref: CheckpointRef, *, share: tuple[int, int],
                 hash_files: bool = True) -> str | None:
        """What is wrong with ``ref`` (one line), or None: its marker, every file's size, and
        the checksums of the files in ``share`` (``(index, count)``: every count-th file from
        the index-th, so that ranks split the reading)."""
        try:
            marker = self.marker(ref)
        except CheckpointCorrupt as exc:
            return str(exc)
        _, path = fsspec.core.url_to_fs(ref.location)
        files = marker.get("files") or {".metadata": None}
        stored = self._stored_sizes(path)  # one listing, not a stat per file
        for name, size in sorted(files.items()):
            actual = stored.get(name)
            if actual is None:
                return f"checkpoint {ref.location}: {name} is missing"
            if size is not None and actual != size:
                return (f"checkpoint {ref.location}: {name} is {actual} bytes, the commit "
                        f"marker says {size} ({'truncated' if actual < size else 'changed'})")
        checksums = marker.get("crc32c") or {}
        unverifiable = self._unverifiable(ref, marker, stored, files, checksums)
        if unverifiable is not None:
            return unverifiable
        index, count = share
        for name in sorted(checksums)[index::count] if hash_files else []:
            try:
                with self._fs.open(f"{path}/{name}", "rb") as f:
                    actual = file_checksum(f).crc32c
            except FileNotFoundError:
                return f"checkpoint {ref.location}: {name} is missing"
            except ValueError as exc:  # the stream's own (a file closed under the read): the
                # store failed, the bytes said nothing, so a retry can pass
                raise OSError(f"reading {path}/{name}: {type(exc).__name__}: {exc}") from exc
            if actual != checksums[name]:
                return (f"checkpoint {ref.location}: {name} does not match its checksum "
                        f"(crc32c {actual}, the commit marker says {checksums[name]}): it "
                        f"changed after it was written")
        return None

    def _stored_sizes(self, path: str) -> dict[str, int]:
        """Every file under ``path`` (relative name → size), as the marker names them."""
        return {full[len(path):].lstrip("/"): int(info["size"])
                for full, info in self._fs.find(path, detail=True).items()
                if info.get("type") != "directory"}

    @staticmethod
    def _unverifiable(ref: CheckpointRef, marker: dict, stored: dict[str, int], files: dict,
                      checksums: dict) -> str | None:
        """A marker of format 3 or later must vouch for every file of its checkpoint: a
        checksum for each file it lists, and every file there listed (DCP would read a file
        the marker leaves out, unverified). Earlier formats had no checksums to lose."""
        if marker.get("format", 1) < 3:
            return None
        unchecked = sorted(set(files) - set(checksums))
        if unchecked:
            return (f"checkpoint {ref.location}: its commit marker has no checksum for "
                    f"{unchecked[0]} ({len(unchecked)} of {len(files)} files), so it cannot be "
                    f"verified and is not loaded")
        unlisted = sorted(name for name in set(stored) - set(files)
                          if name and not name.startswith(COMPLETE_MARKER))
        if unlisted:
            return (f"checkpoint {ref.location}: {unlisted[0]} is there but not in its commit "
                    f"marker ({len(unlisted)} file(s)), so it cannot be verified and is not "
                    f"loaded")
        return None

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
        directory = _join(self.location, name)
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
            name = _name(ref)
            if name == just_committed or (ref.step not in kept_steps and len(kept_steps) < keep):
                if ref.step not in kept_steps:
                    kept_steps.append(ref.step)
                continue
            self._remove(name)
        step = int(_DIR.match(just_committed).group(1))
        for ref in damaged:
            if ref.step <= step:
                self._remove(_name(ref))
        known = {_name(r) for r in committed + damaged}
        for name in self._entries():
            if _DIR.match(name) and name not in known and name != just_committed:
                self._remove(name)

    def move_aside(self) -> str:
        """Move everything at the location to ``<location>.previous-<unix time>`` (rank 0; a
        rename on a local disk, a copy and a delete on object stores); returns the new place."""
        target = f"{self.location}.previous-{int(time.time())}"
        _, target_root = fsspec.core.url_to_fs(target)
        self._fs.mv(self._root, target_root, recursive=True)
        return target

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

    def _verify_on_every_rank(self, ref: CheckpointRef) -> None:
        """:meth:`verify` split over the ranks (rank r hashes every world-th file from the
        r-th; one that :meth:`verify` passed here already, none), the first problem raised on
        every rank."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)
        try:
            problem = self._problem(ref, share=(rank, world),
                                    hash_files=ref.location not in self._content_verified)
            finding = None if problem is None else ("corrupt", problem)
        except OSError as exc:  # the store failed to answer, not the checkpoint
            finding = ("io", f"checkpoint {ref.location}: {describe_error(exc)}")
        if distributed():
            findings: list = [None] * world
            try:
                dist.all_gather_object(findings, finding)
            except Exception as exc:
                raise CheckpointIOError(f"checkpoint {ref.location}: verifying it failed with "
                                        f"a peer ({describe_error(exc)})") from None
            finding = next((f for f in findings if f is not None), None)
        if finding is not None:
            kind, message = finding
            if kind == "io":
                raise CheckpointIOError(message)
            raise CheckpointCorrupt(message, ref)

    def _writer(self, location: str) -> FileSystemWriter:
        """DCP's writer, with every file hashed as it is written."""
        writer = FsspecWriter(location) if _is_url(location) else FileSystemWriter(location)
        writer.fs = ChecksummingFileSystem(writer.fs)
        return writer

    def _reader(self, location: str):
        return FsspecReader(location) if _is_url(location) else FileSystemReader(location)


def _by_commit(ref: CheckpointRef) -> tuple[float, int]:
    return ref.committed_unix, ref.step


def _name(ref: CheckpointRef) -> str:
    """The directory name of ``ref``."""
    return ref.location.rstrip("/").rsplit("/", 1)[-1]


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


def check_model_config(store: CheckpointStore, ref: CheckpointRef, current: dict, *,
                       remedy: str) -> None:
    """Raise :class:`CheckpointError` (one line naming each field that differs and both
    values, then ``remedy``) unless ``ref``'s marker records the model config ``current``
    (``ModelOptions.to_dict()``): before any tensor is read, so another model's checkpoint is
    reported as such, not as a tensor that does not fit, or, for a model with fewer layers,
    not at all. A marker from before configs were recorded passes."""
    saved = store.marker(ref).get("model_config")
    if saved is None:
        return
    raise_if_other_model(ref, saved, current, remedy=remedy)


def raise_if_other_model(ref: CheckpointRef, saved: dict, current: dict, *,
                         remedy: str) -> None:
    """The model-config check, in its one wording (:func:`model_config_differences`):
    :class:`CheckpointError` naming each field that differs and both values, then
    ``remedy``."""
    detail = model_config_differences(saved, current)
    if detail:
        raise CheckpointError(f"model: checkpoint {ref.location} was trained with a different "
                              f"model ({detail}); {remedy}")


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """How a run starts on a checkpoint location (:func:`plan_run`)."""

    lineage: str  # the lineage this run's checkpoints belong to
    restore: tuple[CheckpointRef, ...]  # checkpoints to try, newest first (empty: fresh)
    moved_aside_to: str | None = None  # where an earlier run's checkpoints went


def plan_run(store: CheckpointStore, *, resume: bool, move_aside: bool) -> RunPlan:
    """Decide a run's lineage and what it restores (rank 0, before any training).

    - ``resume``: continue the newest lineage at the location (its checkpoints, newest first,
      with any damaged one in its place by step, to be refused with its reason), or start a
      new one when there is none.
    - not ``resume`` and the location is empty: a new lineage.
    - not ``resume`` with checkpoints present (damaged ones too): refused
      (:class:`LocationInUse`, one line naming the location), unless ``move_aside``: they are
      moved to ``<location>.previous-<time>`` first. Two runs' checkpoints never mix.
    """
    if resume:
        lineage = store.newest_lineage()
        restore = tuple(store.restore_order(lineage or UNKNOWN_LINEAGE))
        return RunPlan(lineage=lineage or new_lineage(), restore=restore)
    if not check_new_run(store, move_aside=move_aside):
        return RunPlan(lineage=new_lineage(), restore=())
    return RunPlan(lineage=new_lineage(), restore=(), moved_aside_to=store.move_aside())


def check_new_run(store: CheckpointStore, *, move_aside: bool) -> bool:
    """Whether a new run (``resume`` off) finds another run's checkpoints at the location
    (then ``move_aside`` must be on); raises :class:`LocationInUse` when they are there and
    it is not. Reads only: :func:`plan_run` does the moving."""
    present = store.committed() + store.damaged()
    if present and not move_aside:
        newest = max(present, key=lambda r: r.step)
        raise LocationInUse(
            f"checkpoint.resume: false, but {store.location} holds checkpoints of an earlier "
            f"run (up to step {newest.step}); resume it (checkpoint.resume: true), give "
            f"checkpoint.path a new place, or set checkpoint.move_aside: true"
        )
    return bool(present)
