"""One run at a time in a run directory: a lock file naming its holder.

    lock = RunLock("runs/quickstart", job="quickstart")
    note = lock.acquire()       # raises RunDirInUse naming the holder; a note if a stale lock
    ...                         # was taken over; lock.refresh() now and then while running
    lock.release()

The lock is ``<run dir>/ringray.lock``, created exclusively (``O_EXCL``), holding the holder's
pid, host, job and start time. A lock is stale when its holder is gone: on the same host, its
pid no longer runs; on another host (which cannot be asked), it has not been refreshed for
:data:`STALE_AFTER_SECONDS`. A stale lock is taken over (renamed away first, so two runs
cannot both take it). Two ``ringray train`` of the same spec would otherwise write the same
checkpoints and interleave their ``steps.jsonl``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "ringray.lock"
STALE_AFTER_SECONDS = 120.0
"""A lock held from another host counts as abandoned when not refreshed for this long (a
holder refreshes it at least every :data:`REFRESH_SECONDS`)."""
REFRESH_SECONDS = 30.0


class RunDirInUse(ValueError):
    """Another live run holds the run directory (one line naming it and the holder)."""


@dataclass(frozen=True, kw_only=True)
class LockHolder:
    pid: int
    host: str
    job: str
    since_unix: float
    refreshed_unix: float  # the lock file's modification time

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_unix))
        return f"job {self.job!r} (pid {self.pid} on {self.host}, since {since})"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def holder_alive(holder: LockHolder, *, now: float | None = None) -> bool:
    """Whether ``holder`` still holds its lock (see the module's docstring)."""
    if holder.host == socket.gethostname():
        return _pid_running(holder.pid)
    now = time.time() if now is None else now
    return now - holder.refreshed_unix < STALE_AFTER_SECONDS


class RunLock:
    """The lock of one run directory, for one holder (this process)."""

    def __init__(self, run_dir: str | Path, *, job: str) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.job = job
        self.held = False
        self._refreshed = 0.0

    def holder(self) -> LockHolder | None:
        """Who holds the lock now (alive or not), or ``None``."""
        try:
            data = json.loads(self.path.read_text())
            refreshed = self.path.stat().st_mtime
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None
        try:
            return LockHolder(pid=int(data["pid"]), host=str(data["host"]),
                              job=str(data["job"]), since_unix=float(data["since_unix"]),
                              refreshed_unix=refreshed)
        except (KeyError, TypeError, ValueError):
            return None

    def check(self) -> None:
        """Raise :class:`RunDirInUse` if a live holder other than this process has it."""
        holder = self.holder()
        if holder is not None and holder_alive(holder) and not self._is_me(holder):
            raise RunDirInUse(f"run_dir: {self.path.parent} is in use by {holder.describe()}; "
                              f"wait for it, stop it, or give this run another run_dir")

    def _is_me(self, holder: LockHolder) -> bool:
        return holder.pid == os.getpid() and holder.host == socket.gethostname()

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale lock was taken over.

        Raises:
            RunDirInUse: a live run holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is not None and self._is_me(holder):
                    self.held = True
                    return note
                if holder is not None and holder_alive(holder):
                    self.check()
                note = self._take_over(holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "job": self.job,
                           "since_unix": time.time()}, f)
            self.held = True
            self._refreshed = time.monotonic()
            return note
        raise RunDirInUse(f"run_dir: {self.path.parent}: could not take the lock {self.path} "
                          f"(another run is taking it at the same time)")

    def _take_over(self, holder: LockHolder | None) -> str:
        """Move a stale (or unreadable) lock away; only one of several racing runs wins."""
        stale = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, stale)
            stale.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        who = holder.describe() if holder else "an unreadable lock"
        return f"took over the run directory's lock from {who}, which no longer runs"

    def refresh(self) -> None:
        """Mark the lock alive (cheap; at most once per :data:`REFRESH_SECONDS`)."""
        if self.held and time.monotonic() - self._refreshed >= REFRESH_SECONDS:
            self._refreshed = time.monotonic()
            try:
                os.utime(self.path)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        """Give the lock up (only if this process holds it)."""
        if not self.held:
            return
        holder = self.holder()
        if holder is not None and self._is_me(holder):
            self.path.unlink(missing_ok=True)
        self.held = False
