"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), committed by a marker written
last, safe on any fsspec store (a local disk, s3://, gs://, memory://).

    store = CheckpointStore("runs/quickstart/checkpoints", lineage=run_id)   # or "s3://b/job"
    ref = store.save(step, state, keep=3, extra={"model_config": {...}})    # collective
    ref = store.latest()                # newest committed checkpoint of the newest lineage
    store.load(ref, state)              # verifies the files first, then fills ``state``

**The commit protocol.** A save writes its shards straight into the directory where they stay,
``step_00000042-<token>`` (the token makes every save's directory new, so saving a step again
never touches an earlier copy). Once every rank has written (a barrier), rank 0 lists the
directory and writes ``ringray-complete.json``: the step, the run's lineage, the world size,
the model's config, and every file's size. That marker, written last as one object, is the
commit. Nothing is renamed (on object stores a rename is a copy and a delete). A crash at any
point before the marker leaves an uncommitted directory that nothing loads; the previous
checkpoint stays the newest committed one.

**Lineage.** Every run has a lineage id, written into its markers; a resumed run continues the
lineage of the checkpoint it resumed from (:func:`plan_run`). Pruning deletes only older
checkpoints of this lineage (keeping the newest ``keep``, and never the one just committed),
and an earlier copy of the same step only after its replacement is committed; it un-commits a
checkpoint (deletes its marker) before deleting its files, so a crash while pruning never
leaves a "committed" checkpoint with missing files.

**Refusing corrupt checkpoints.** :meth:`CheckpointStore.verify` compares the files with the
marker's sizes: a missing or truncated file raises :class:`CheckpointCorrupt` naming it, and
:func:`restore_candidates` lets a caller fall back to the previous checkpoint. DCP's own
errors are unwrapped: a full disk or a permission error becomes :class:`CheckpointWriteError`
(naming the errno and the path), which no retry can fix.
"""

from __future__ import annotations

import errno
import functools
import json
import re
import time
import uuid
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from ringray.train.collective import distributed, is_rank0, on_rank0

COMPLETE_MARKER = "ringray-complete.json"
MARKER_FORMAT = 2
LEGACY_LINEAGE = "legacy"  # checkpoints committed before lineages (marker format 1)
_DIR = re.compile(r"^step_(\d{8})(?:-([0-9a-f]{8}))?(\.partial)?$")
# Errors no retry can fix: the store is full, read-only, or not ours to write.
DETERMINISTIC_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM,
                                  errno.EROFS, errno.ENAMETOOLONG, errno.ENOTDIR})


class CheckpointError(ValueError):
    """A checkpoint problem that a retry cannot fix (a ``ValueError``, so the service does not
    retry it); the message is one line naming the checkpoint and the cause."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint whose files do not match its marker (missing, truncated), or
    whose marker cannot be read. ``ref`` is the checkpoint, so a caller can fall back."""

    def __init__(self, message: str, ref: CheckpointRef) -> None:
        super().__init__(message)
        self.ref = ref

    def __reduce__(self):  # survives pickling (Ray sends it from a worker to the controller)
        return (type(self), (str(self), self.ref))


class CheckpointWriteError(CheckpointError):
    """Saving failed for a reason a retry cannot fix (no space, no permission, read-only)."""


class CheckpointIOError(RuntimeError):
    """Saving or loading failed for a reason that may pass (a dropped connection, a peer that
    died mid-save): recovering from the previous checkpoint is the remedy."""


class LocationInUse(ValueError):
    """``checkpoint.resume`` is off but the location already holds another run's checkpoints."""


@dataclass(frozen=True)
class CheckpointRef:
    """One committed checkpoint."""

    step: int
    location: str  # its directory (path or URL)
    lineage: str = LEGACY_LINEAGE  # the run it belongs to
    committed_unix: float = 0.0


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


def root_cause(exc: BaseException) -> BaseException:
    """What really went wrong: the first rank's exception inside DCP's ``CheckpointException``
    (which lists every rank's failure with its traceback), and below that the ``OSError`` a
    library error was raised from (torch's serializer turns a failed write into a
    ``RuntimeError`` whose context is the ``OSError``); else ``exc`` itself."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first, _trace = next(iter(exc.failures.values()))
        if isinstance(first, BaseException):
            return root_cause(first)
        return exc
    seen, current = set(), exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return exc


def describe_error(exc: BaseException) -> str:
    """One line: ``ENOSPC (No space left on device): /path/file`` for an ``OSError``, else the
    exception's type and first line."""
    cause = root_cause(exc)
    if isinstance(cause, OSError) and cause.errno is not None:
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        where = cause.filename or ""
        return f"{name} ({cause.strerror}){': ' + str(where) if where else ''}"
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def is_deterministic(exc: BaseException) -> bool:
    """Whether a save or load failure would happen again on a retry."""
    cause = root_cause(exc)
    return isinstance(cause, OSError) and cause.errno in DETERMINISTIC_ERRNOS


class CheckpointStore:
    """The checkpoints under ``location`` (a path or an fsspec URL); saves and pruning belong to
    ``lineage`` (a new one if not given)."""

    def __init__(self, location: str, *, lineage: str | None = None) -> None:
        self.location = location.rstrip("/") or location
        self.lineage = lineage or new_lineage()
        self._fs, self._root = fsspec.core.url_to_fs(self.location)
        self.warnings: list[str] = []  # what went wrong but did not fail a save (for the log)

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

    def _marker(self, name: str) -> dict | None:
        """The parsed marker of directory ``name``; ``None`` if it has none, or one that cannot
        be read (a commit cut short: treated as not committed)."""
        path = f"{self._root}/{name}/{COMPLETE_MARKER}"
        try:
            with self._fs.open(path, "r") as f:
                marker = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return marker if isinstance(marker, dict) and "step" in marker else None

    def committed(self) -> list[CheckpointRef]:
        """Every committed checkpoint at the location (any lineage), oldest commit first."""
        refs = []
        for name in self._entries():
            match = _DIR.match(name)
            if not match or match.group(3):  # not a checkpoint, or a legacy .partial
                continue
            marker = self._marker(name)
            if marker is None:
                continue
            refs.append(CheckpointRef(
                step=int(marker["step"]), location=_join(self.location, name),
                lineage=str(marker.get("lineage", LEGACY_LINEAGE)),
                committed_unix=float(marker.get("committed_unix", 0.0)),
            ))
        return sorted(refs, key=lambda r: (r.committed_unix, r.step))

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
        location), or ``None``. Not verified: see :func:`restore_candidates`."""
        lineage = lineage or self.newest_lineage()
        if lineage is None:
            return None
        refs = self.of_lineage(lineage)
        return refs[0] if refs else None

    def marker(self, ref: CheckpointRef) -> dict:
        """The commit marker of ``ref`` (raises :class:`CheckpointCorrupt` if unreadable)."""
        name = ref.location.rstrip("/").rsplit("/", 1)[-1]
        marker = self._marker(name)
        if marker is None:
            raise CheckpointCorrupt(f"checkpoint {ref.location}: its marker {COMPLETE_MARKER} "
                                    f"is missing or unreadable", ref)
        return marker

    def verify(self, ref: CheckpointRef) -> None:
        """Raise :class:`CheckpointCorrupt` (one line naming the file) unless every file the
        marker lists is there with its recorded size. Markers without a file list (written
        before sizes were recorded) are checked for DCP's ``.metadata`` only."""
        marker = self.marker(ref)
        _, path = fsspec.core.url_to_fs(ref.location)
        files = marker.get("files") or {".metadata": None}
        for name, size in sorted(files.items()):
            full = f"{path}/{name}"
            try:
                actual = self._fs.size(full)
            except FileNotFoundError:
                actual = None
            if actual is None:
                raise CheckpointCorrupt(f"checkpoint {ref.location}: {name} is missing", ref)
            if size is not None and actual != size:
                raise CheckpointCorrupt(
                    f"checkpoint {ref.location}: {name} is {actual} bytes, the commit marker "
                    f"says {size} ({'truncated' if actual < size else 'changed'})", ref)

    # ----------------------------------------------------------------- writing
    def save(self, step: int, state: dict[str, Any], *, keep: int,
             extra: dict | None = None) -> CheckpointRef:
        """Write ``state`` as the checkpoint of ``step`` and commit it (collective: every rank
        calls it). ``extra`` goes into the marker (e.g. the model's config, readable before
        any tensor is loaded).

        Raises:
            CheckpointWriteError: a failure a retry cannot fix (ENOSPC, EACCES, EROFS ...),
                after removing the uncommitted directory.
            CheckpointIOError: any other failure of the write (also cleaned up).
        """
        if keep < 1:
            raise ValueError(f"keep: must be >= 1, got {keep}")
        name = f"step_{step:08d}-{uuid.uuid4().hex[:8]}"
        # Rank 0's own steps (the directory, the marker) end in a broadcast of how they went,
        # so a failure there raises on every rank instead of leaving the others in a barrier.
        name = self._on_coordinator(step, lambda: self._prepare(name))
        directory = _join(self.location, name)
        try:
            with _quiet_single_process():
                dcp.save(state, storage_writer=self._writer(directory))
        except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
            # Rank 0 cleans up and says why, for every rank (they must agree on whether a
            # retry can help).
            why, deterministic = on_rank0(functools.partial(self._diagnose, name, exc))
            raise self._save_error(step, why, deterministic) from None
        _barrier()  # every rank's shards are on storage
        self._on_coordinator(step, lambda: self._commit(name, step, extra or {}))
        if is_rank0():
            try:
                self._prune(name, keep)
            except Exception as exc:  # the new checkpoint is committed; old ones linger
                self.warnings.append(f"pruning {self.location} after step {step} failed: "
                                     f"{describe_error(exc)}")
        _barrier()
        return CheckpointRef(step=step, location=directory, lineage=self.lineage)

    def _diagnose(self, name: str, exc: BaseException) -> tuple[str, bool]:
        """Rank 0, after a failed write: remove its directory; the cause, and whether a retry
        cannot help. When the error does not say (torch's serializer can turn a full disk
        into ``RuntimeError: unexpected pos``), a probe write as large as the last checkpoint
        asks the store itself."""
        try:
            self._remove(name)
        except Exception as cleanup:  # reported with the cause, which matters more
            self.warnings.append(f"could not remove {name}: {describe_error(cleanup)}")
        if is_deterministic(exc):
            return describe_error(exc), True
        probe = f"{self._root}/.ringray-probe-{uuid.uuid4().hex[:8]}"
        try:
            self._fs.pipe(probe, bytes(self._probe_bytes()))
        except OSError as probe_error:
            if is_deterministic(probe_error):
                return f"{describe_error(probe_error)} (found by a probe write after " \
                       f"{describe_error(exc)})", True
        finally:
            try:
                if self._fs.exists(probe):
                    self._fs.rm(probe)
            except OSError:
                pass
        return describe_error(exc), False

    def _probe_bytes(self) -> int:
        """As many bytes as the newest committed checkpoint of this lineage holds (1 MiB to
        64 MiB): what the failed save would have needed, about."""
        size = 1 << 20
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

    def _save_error(self, step: int, why: str, deterministic: bool) -> CheckpointError:
        kind = CheckpointWriteError if deterministic else CheckpointIOError
        return kind(f"checkpoint of step {step} at {self.location} failed: {why}")

    def _on_coordinator(self, step: int, work: Callable[[], Any]) -> Any:
        """Run ``work`` on rank 0 and give its result to every rank; if it raised, every rank
        raises the classified error."""
        def classified() -> Any:
            try:
                return work()
            except Exception as exc:
                raise self._save_error(step, describe_error(exc), is_deterministic(exc)) from None

        return on_rank0(classified)

    def _commit(self, name: str, step: int, extra: dict) -> None:
        """Rank 0: list the files and write the marker, last (on failure the directory is
        removed: an uncommitted save leaves nothing behind)."""
        try:
            self._write_marker(name, step, extra)
        except BaseException:
            self._remove(name)
            raise

    def _write_marker(self, name: str, step: int, extra: dict) -> None:
        path = f"{self._root}/{name}"
        files = {}
        for full, info in self._fs.find(path, detail=True).items():
            relative = full[len(path):].lstrip("/")
            if relative and relative != COMPLETE_MARKER and info.get("type") != "directory":
                files[relative] = int(info["size"])
        marker = {
            "format": MARKER_FORMAT, "step": step, "lineage": self.lineage,
            "world_size": dist.get_world_size() if distributed() else 1,
            "committed_unix": time.time(), "files": files, **extra,
        }
        self._fs.pipe(f"{path}/{COMPLETE_MARKER}", json.dumps(marker).encode())

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
        by a crashed save. Other lineages' checkpoints are never touched."""
        kept_steps: list[int] = []
        for ref in self.of_lineage():
            name = ref.location.rstrip("/").rsplit("/", 1)[-1]
            if name == just_committed or (ref.step not in kept_steps and len(kept_steps) < keep):
                if ref.step not in kept_steps:
                    kept_steps.append(ref.step)
                continue
            self._remove(name)
        committed = {r.location.rstrip("/").rsplit("/", 1)[-1] for r in self.committed()}
        for name in self._entries():
            if _DIR.match(name) and name not in committed and name != just_committed:
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
        """Fill ``state`` in place from ``ref``, after :meth:`verify`.

        Raises:
            CheckpointCorrupt: files missing or truncated, or DCP cannot read them.
            CheckpointIOError: a failure that may pass (a dropped connection).
        """
        self.verify(ref)
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=self._reader(ref.location))
        except (Exception, CheckpointException) as exc:
            cause = root_cause(exc)
            if isinstance(cause, OSError) and not is_deterministic(exc) and not isinstance(
                    cause, FileNotFoundError):
                raise CheckpointIOError(f"checkpoint {ref.location}: "
                                        f"{describe_error(exc)}") from None
            raise CheckpointCorrupt(f"checkpoint {ref.location} cannot be read: "
                                    f"{describe_error(exc)}", ref) from None

    def _writer(self, location: str):
        return FsspecWriter(location) if _is_url(location) else FileSystemWriter(location)

    def _reader(self, location: str):
        return FsspecReader(location) if _is_url(location) else FileSystemReader(location)


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """How a run starts on a checkpoint location (:func:`plan_run`)."""

    lineage: str  # the lineage this run's checkpoints belong to
    restore: tuple[CheckpointRef, ...]  # checkpoints to try, newest first (empty: fresh)
    moved_aside_to: str | None = None  # where an earlier run's checkpoints went


def plan_run(store: CheckpointStore, *, resume: bool, move_aside: bool) -> RunPlan:
    """Decide a run's lineage and what it restores (rank 0, before any training).

    - ``resume``: continue the newest lineage at the location (its checkpoints, newest first),
      or start a new one when there is none.
    - not ``resume`` and the location is empty: a new lineage.
    - not ``resume`` with checkpoints present: refused (:class:`LocationInUse`, one line
      naming the location), unless ``move_aside``: they are moved to ``<location>.previous-
      <time>`` first. Two runs' checkpoints never mix.
    """
    if resume:
        lineage = store.newest_lineage()
        if lineage is None:
            return RunPlan(lineage=new_lineage(), restore=())
        return RunPlan(lineage=lineage, restore=tuple(store.of_lineage(lineage)))
    if not check_new_run(store, move_aside=move_aside):
        return RunPlan(lineage=new_lineage(), restore=())
    return RunPlan(lineage=new_lineage(), restore=(), moved_aside_to=store.move_aside())


def check_new_run(store: CheckpointStore, *, move_aside: bool) -> bool:
    """Whether a new run (``resume`` off) finds another run's checkpoints at the location
    (then ``move_aside`` must be on); raises :class:`LocationInUse` when they are there and
    it is not. Reads only: :func:`plan_run` does the moving."""
    committed = store.committed()
    if committed and not move_aside:
        newest = max(committed, key=lambda r: r.step)
        raise LocationInUse(
            f"checkpoint.resume: false, but {store.location} holds checkpoints of an earlier "
            f"run (up to step {newest.step}); resume it (checkpoint.resume: true), give "
            f"checkpoint.path a new place, or set checkpoint.move_aside: true"
        )
    return bool(committed)


def restore_candidates(
    store: CheckpointStore, refs: tuple[CheckpointRef, ...],
    *, refused: Callable[[CheckpointCorrupt], None],
) -> CheckpointRef | None:
    """The newest of ``refs`` (newest first) that passes :meth:`CheckpointStore.verify`;
    ``refused`` is told about each one that does not (for the run's log)."""
    for ref in refs:
        try:
            store.verify(ref)
        except CheckpointCorrupt as exc:
            refused(exc)
            continue
        return ref
    return None
