"""One run per run directory: the lock refuses a second live run in one line naming the
holder, and a lock whose holder is gone (a dead pid here, or no refresh from another host)
is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringray.train.run_lock import (
    LOCK_NAME,
    STALE_AFTER_SECONDS,
    RunDirInUse,
    RunLock,
)


def _write_lock(run_dir: Path, *, pid: int, host: str, age_seconds: float = 0.0) -> Path:
    path = run_dir / LOCK_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "host": host, "job": "first",
                                "since_unix": time.time() - age_seconds}))
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_acquire_holds_and_release_frees(tmp_path: Path) -> None:
    lock = RunLock(tmp_path / "run", job="quick")
    assert lock.acquire() is None
    holder = lock.holder()
    assert (holder.pid, holder.host, holder.job) == (os.getpid(), socket.gethostname(), "quick")
    lock.check()  # held by this process: fine
    lock.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_live_holder_refuses_a_second_run_in_one_line(tmp_path: Path) -> None:
    _write_lock(tmp_path, pid=os.getppid(), host=socket.gethostname())
    with pytest.raises(RunDirInUse) as info:
        RunLock(tmp_path, job="second").acquire()
    message = str(info.value)
    assert "\n" not in message
    assert f"run_dir: {tmp_path} is in use by job 'first' (pid {os.getppid()}" in message


def test_a_lock_whose_process_died_is_taken_over(tmp_path: Path) -> None:
    pid = _dead_pid()
    _write_lock(tmp_path, pid=pid, host=socket.gethostname())
    lock = RunLock(tmp_path, job="second")
    note = lock.acquire()
    assert note is not None and f"pid {pid}" in note and "no longer runs" in note
    assert lock.holder().pid == os.getpid()


def test_another_hosts_lock_is_stale_only_without_refreshes(tmp_path: Path) -> None:
    _write_lock(tmp_path, pid=1, host="some-other-host", age_seconds=10)
    with pytest.raises(RunDirInUse, match="some-other-host"):
        RunLock(tmp_path, job="second").acquire()
    _write_lock(tmp_path, pid=1, host="some-other-host", age_seconds=STALE_AFTER_SECONDS + 5)
    assert "some-other-host" in RunLock(tmp_path, job="second").acquire()


def test_an_unreadable_lock_is_taken_over(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("{not json")
    assert "unreadable" in RunLock(tmp_path, job="second").acquire()
