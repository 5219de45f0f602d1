"""Sharded, atomically committed checkpoints with ``torch.distributed.checkpoint`` (DCP).

    store = CheckpointStore("runs/quickstart/checkpoints")     # or "s3://bucket/job", ...
    store.save(step, state, keep=3)     # collective: every rank calls it
    ref = store.latest()                # the newest *complete* checkpoint, or None
    store.load(ref, state)              # fills ``state`` in place

A checkpoint is a directory ``step_00000042``. It is written under a temporary name
(``step_00000042.partial``); when DCP's save returns on a rank, that rank's shards are
written, and after a barrier (every rank finished) rank 0 writes the completion marker and
renames the directory to its final name. Only directories with the final name *and* the
marker count, so a crash at any point of a save leaves the previous complete checkpoint as
the one that loads. Rank 0 then deletes all but the newest ``keep`` complete checkpoints.

The location is a local path or an fsspec URL (DCP's fsspec storage). A multi-node job needs
a location every node can reach: a shared filesystem or an object store.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

COMPLETE_MARKER = "ringray-complete.json"
_FINAL = re.compile(r"^step_(\d{8})$")
_PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class CheckpointRef:
    """One complete checkpoint: its step and its location (path or URL)."""

    step: int
    location: str


def _is_url(location: str) -> bool:
    return "://" in location


def _join(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when torch.distributed is not initialised;
    here that is the intent (a 1-rank run), so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_coordinator() -> bool:
    return not _distributed() or dist.get_rank() == 0


class CheckpointStore:
    """The checkpoints of one run under ``location`` (a path or an fsspec URL)."""

    def __init__(self, location: str) -> None:
        self.location = location.rstrip("/") or location
        self._fs, self._root = fsspec.core.url_to_fs(self.location)

    def _name_for(self, step: int) -> str:
        return f"step_{step:08d}"

    def complete(self) -> list[CheckpointRef]:
        """Every complete checkpoint, oldest first."""
        if not self._fs.exists(self._root):
            return []
        refs = []
        for entry in self._fs.ls(self._root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            match = _FINAL.match(name)
            if match and self._fs.exists(f"{self._root}/{name}/{COMPLETE_MARKER}"):
                refs.append(CheckpointRef(int(match.group(1)), _join(self.location, name)))
        return sorted(refs, key=lambda ref: ref.step)

    def latest(self) -> CheckpointRef | None:
        """The newest complete checkpoint (partial ones are never returned)."""
        refs = self.complete()
        return refs[-1] if refs else None

    def save(self, step: int, state: dict[str, Any], *, keep: int) -> CheckpointRef:
        """Write ``state`` as the checkpoint of ``step`` and commit it (collective).

        ``state`` is a DCP state dict: tensors, nested dicts and picklable values. Values
        that are equal on every rank (replicated weights) are written once.
        """
        if keep < 1:
            raise ValueError(f"keep: must be >= 1, got {keep}")
        name = self._name_for(step)
        partial = f"{self._root}/{name}{_PARTIAL_SUFFIX}"
        if _is_coordinator():
            self._fs.makedirs(self._root, exist_ok=True)
            if self._fs.exists(partial):  # left by a run that crashed while saving this step
                self._fs.rm(partial, recursive=True)
        _barrier()
        partial_location = _join(self.location, name + _PARTIAL_SUFFIX)
        with _quiet_single_process():
            dcp.save(state, storage_writer=self._writer(partial_location))
        self._commit(step, partial, keep)
        return CheckpointRef(step, _join(self.location, name))

    def _commit(self, step: int, partial: str, keep: int) -> None:
        # Every rank has returned from DCP's save, so every shard is on storage.
        _barrier()
        if _is_coordinator():
            world = dist.get_world_size() if _distributed() else 1
            marker = {"step": step, "world_size": world, "committed_unix": time.time()}
            with self._fs.open(f"{partial}/{COMPLETE_MARKER}", "w") as f:
                json.dump(marker, f)
            final = f"{self._root}/{self._name_for(step)}"
            if self._fs.exists(final):  # an older save of the same step (a rerun)
                self._fs.rm(final, recursive=True)
            self._fs.mv(partial, final, recursive=True)
            self._prune(step, keep)
        _barrier()

    def _prune(self, newest_step: int, keep: int) -> None:
        """Delete all but the newest ``keep`` complete checkpoints, and partial ones older
        than ``newest_step`` (left by crashed saves). Rank 0 only."""
        for ref in self.complete()[:-keep]:
            self._fs.rm(f"{self._root}/{self._name_for(ref.step)}", recursive=True)
        for entry in self._fs.ls(self._root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            stem = name.removesuffix(_PARTIAL_SUFFIX)
            match = _FINAL.match(stem)
            if name.endswith(_PARTIAL_SUFFIX) and match and int(match.group(1)) < newest_step:
                self._fs.rm(f"{self._root}/{name}", recursive=True)

    def load(self, ref: CheckpointRef, state: dict[str, Any]) -> None:
        """Fill ``state`` in place from the complete checkpoint ``ref``."""
        fs, path = fsspec.core.url_to_fs(ref.location)
        if not fs.exists(f"{path}/{COMPLETE_MARKER}"):
            raise ValueError(f"checkpoint {ref.location} is not complete (no {COMPLETE_MARKER})")
        with _quiet_single_process():
            dcp.load(state, storage_reader=self._reader(ref.location))

    def _writer(self, location: str):
        return FsspecWriter(location) if _is_url(location) else FileSystemWriter(location)

    def _reader(self, location: str):
        return FsspecReader(location) if _is_url(location) else FileSystemReader(location)
