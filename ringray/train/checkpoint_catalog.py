"""The checkpoints at a location as they are: scanning, commit markers and verification.

    catalog = CheckpointCatalog("runs/quickstart/checkpoints", lineage=run_id)
    catalog.committed(), catalog.damaged()      # every committed / damaged checkpoint there
    catalog.latest(), catalog.restore_order()   # what a resume tries, newest first
    catalog.verify(ref)                         # sizes and CRC-32Cs against the marker

:class:`~ringray.train.checkpoint.CheckpointStore` (saving, committing, pruning, loading) is a
catalog that writes; the new-run check and the move aside are
:mod:`~ringray.train.checkpoint_runs`. The protocol is described in
:mod:`~ringray.train.checkpoint`.
"""

from __future__ import annotations

import json
import re
import uuid

import fsspec
import torch.distributed as dist

from ringray.train.checkpoint_errors import (
    CheckpointCorrupt,
    CheckpointIOError,
    describe_error,
)
from ringray.train.checkpoint_ref import LEGACY_LINEAGE, CheckpointRef
from ringray.train.checksums import file_checksum
from ringray.train.collective import distributed

COMPLETE_MARKER = "ringray-complete.json"
MARKER_FORMAT = 3  # 3: "crc32c" per file; 2: sizes only ("files"); 1: no lineage
UNKNOWN_LINEAGE = "unknown"  # a damaged checkpoint's: its marker cannot be read
CHECKPOINT_DIR = re.compile(r"^step_(\d{8})(?:-([0-9a-f]{8}))?(\.partial)?$")


def is_url(location: str) -> bool:
    return "://" in location


def join_location(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}"


def new_lineage() -> str:
    """A new run's lineage id."""
    return uuid.uuid4().hex[:12]


def _by_commit(ref: CheckpointRef) -> tuple[float, int]:
    return ref.committed_unix, ref.step


def dir_name(ref: CheckpointRef) -> str:
    """The directory name of ``ref``."""
    return ref.location.rstrip("/").rsplit("/", 1)[-1]


class CheckpointCatalog:
    """The checkpoints under ``location`` (a path or an fsspec URL), read and verified; a
    store's saves and pruning belong to ``lineage`` (a new one if not given)."""

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
            match = CHECKPOINT_DIR.match(name)
            if not match or match.group(3):  # not a checkpoint, or a legacy .partial
                continue
            marker, damage = self._read_marker(name)
            location = join_location(self.location, name)
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
