"""One run at a time in a run directory: a lock file naming its holder.

    lock = RunLock("runs/quickstart", job="quickstart")
    note = lock.acquire()       # raises RunDirInUse naming the holder; a note if a stale lock
    ...                         # was taken over; a heartbeat thread keeps it fresh meanwhile
    lock.release()

The lock is ``<run dir>/ringray.lock``, holding the holder's pid, host, job and start time,
and, where ``/proc`` tells it, the process's own start (boot id and start tick), since pids
are reused (in a container the next run is often pid 1 again). It appears whole: the
content is written to a private file first and hard-linked into place (``link`` fails when
the name exists, like ``O_EXCL``), so a racer never reads a half-written lock. A lock is
stale when its holder is gone: on the same host, its pid no longer runs, or runs another
process than the one that took the lock (another start); on another host (which cannot be
asked), it has not been refreshed for :data:`STALE_AFTER_SECONDS`. While held, a daemon
thread refreshes it every :data:`REFRESH_SECONDS` whatever the holder is doing, so a step
longer than the stale limit does not make a live lock look abandoned. Taking over a stale
lock happens under an exclusive ``flock`` of ``ringray.lock.guard``, so of several racing
runs exactly one wins and none can move away a lock that another has just taken. Two
``ringray train`` of the same spec
would otherwise write the same checkpoints and interleave their ``steps.jsonl``.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "ringray.lock"
GUARD_NAME = "ringray.lock.guard"
STALE_AFTER_SECONDS = 120.0
"""A lock held from another host counts as abandoned when not refreshed for this long (a
holder's heartbeat refreshes it every :data:`REFRESH_SECONDS`)."""
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
    process_start: str | None = None  # process_start(pid) when it took the lock

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


def process_start(pid: int) -> str | None:
    """Which process ``pid`` is, as no later process with the same pid can be: this boot's id
    and the process's start in clock ticks since the boot (``/proc/<pid>/stat``'s 22nd
    field); ``None`` where ``/proc`` does not say (not Linux, or no such process)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces or parentheses
    fields = stat[stat.rindex(")") + 2:].split()
    return f"{boot}:{fields[19]}"  # field 22 overall is the 20th after the name


def holder_alive(holder: LockHolder, *, now: float | None = None) -> bool:
    """Whether ``holder`` still holds its lock (see the module's docstring)."""
    if holder.host == socket.gethostname():
        if not _pid_running(holder.pid):
            return False
        if holder.process_start is None:  # a lock written without it (or not on Linux)
            return True
        current = process_start(holder.pid)
        return current is None or current == holder.process_start
    now = time.time() if now is None else now
    return now - holder.refreshed_unix < STALE_AFTER_SECONDS


class RunLock:
    """The lock of one run directory, for one holder (this process)."""

    def __init__(self, run_dir: str | Path, *, job: str,
                 refresh_seconds: float = REFRESH_SECONDS) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.job = job
        self.refresh_seconds = refresh_seconds
        self.held = False
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def holder(self) -> LockHolder | None:
        """Who holds the lock now (alive or not), or ``None``."""
        try:
            data = json.loads(self.path.read_text())
            refreshed = self.path.stat().st_mtime
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None
        try:
            start = data.get("process_start")
            return LockHolder(pid=int(data["pid"]), host=str(data["host"]),
                              job=str(data["job"]), since_unix=float(data["since_unix"]),
                              refreshed_unix=refreshed,
                              process_start=None if start is None else str(start))
        except (KeyError, TypeError, ValueError):
            return None

    def check(self) -> None:
        """Raise :class:`RunDirInUse` if a live holder other than this process has it."""
        holder = self.holder()
        if holder is not None and holder_alive(holder) and not self._is_me(holder):
            raise RunDirInUse(f"run_dir: {self.path.parent} is in use by {holder.describe()}; "
                              f"wait for it, stop it, or give this run another run_dir")

    def _is_me(self, holder: LockHolder) -> bool:
        return (holder.pid == os.getpid() and holder.host == socket.gethostname()
                and holder.process_start in (None, process_start(os.getpid())))

    def acquire(self) -> str | None:
        """Take the lock and start its heartbeat; returns a note when a stale lock was taken
        over.

        Raises:
            RunDirInUse: a live run holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        with self._guard():
            for _ in range(3):
                if self._create():
                    self.held = True
                    self._start_heartbeat()
                    return note
                holder = self.holder()
                if holder is not None and self._is_me(holder):
                    self.held = True
                    self._start_heartbeat()
                    return note
                if holder is not None and holder_alive(holder):
                    self.check()
                note = self._take_over(holder)
        raise RunDirInUse(f"run_dir: {self.path.parent}: could not take the lock {self.path} "
                          f"(another run is taking it at the same time)")

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Serialise acquirers of this run directory (an exclusive ``flock``), so a stale
        lock is judged and moved away by one of them at a time."""
        fd = os.open(self.path.with_name(GUARD_NAME), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _create(self) -> bool:
        """Create the lock file with its content in one step; ``False`` if it exists."""
        private = self.path.with_name(f"{LOCK_NAME}.{socket.gethostname()}-{os.getpid()}")
        private.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "job": self.job, "since_unix": time.time(),
                                       "process_start": process_start(os.getpid())}))
        try:
            os.link(private, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            private.unlink(missing_ok=True)

    def _take_over(self, holder: LockHolder | None) -> str:
        """Remove a stale (or unreadable) lock; called under the guard."""
        self.path.unlink(missing_ok=True)
        who = holder.describe() if holder else "an unreadable lock"
        return f"took over the run directory's lock from {who}, which no longer runs"

    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return
        self._stop_heartbeat.clear()
        self._heartbeat = threading.Thread(target=self._beat, name="ringray-lock-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop_heartbeat.wait(self.refresh_seconds):
            self.refresh()

    def refresh(self) -> None:
        """Mark the lock alive now (the heartbeat does this every ``refresh_seconds``)."""
        if self.held:
            try:
                os.utime(self.path)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        """Stop the heartbeat and give the lock up (only if this process holds it)."""
        if self._heartbeat is not None:
            self._stop_heartbeat.set()
            self._heartbeat.join()
            self._heartbeat = None
        if not self.held:
            return
        holder = self.holder()
        if holder is not None and self._is_me(holder):
            self.path.unlink(missing_ok=True)
        self.held = False
