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

import ringray.train.run_lock as run_lock_module
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


def test_a_lock_whose_pid_now_runs_another_process_is_taken_over(tmp_path: Path) -> None:
    """Pids are reused (a container's next run is often pid 1 again): a lock whose pid runs,
    but a process started at another time than the lock's holder, is stale. Here the pid is
    the live parent's, its recorded start one tick off; the same lock with the parent's true
    start is live."""
    parent = os.getppid()
    start = run_lock_module.process_start(parent)
    assert start is not None  # Linux: /proc tells
    boot, tick = start.rsplit(":", 1)
    path = _write_lock(tmp_path, pid=parent, host=socket.gethostname())
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "process_start": start}))
    with pytest.raises(RunDirInUse, match=f"pid {parent}"):
        RunLock(tmp_path, job="second").acquire()
    path.write_text(json.dumps({**record, "process_start": f"{boot}:{int(tick) + 1}"}))
    lock = RunLock(tmp_path, job="second")
    note = lock.acquire()
    assert note is not None and f"pid {parent}" in note and "no longer runs" in note
    assert lock.holder().pid == os.getpid()
    assert lock.holder().process_start == run_lock_module.process_start(os.getpid())
    lock.release()


def test_another_hosts_lock_is_stale_only_without_refreshes(tmp_path: Path) -> None:
    _write_lock(tmp_path, pid=1, host="some-other-host", age_seconds=10)
    with pytest.raises(RunDirInUse, match="some-other-host"):
        RunLock(tmp_path, job="second").acquire()
    _write_lock(tmp_path, pid=1, host="some-other-host", age_seconds=STALE_AFTER_SECONDS + 5)
    assert "some-other-host" in RunLock(tmp_path, job="second").acquire()


def test_an_unreadable_lock_is_taken_over(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("{not json")
    assert "unreadable" in RunLock(tmp_path, job="second").acquire()


# The racing processes load run_lock.py by its path (it imports only the standard library),
# which starts them in a fraction of a second.
RUN_LOCK_FILE = str(Path(run_lock_module.__file__))
_LOAD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[3])
run_lock = sys.modules["run_lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
"""
_HOLDER = _LOAD + """
import socket, time
socket.gethostname = lambda: "host-a"          # a holder on another host: judged by refreshes
lock = run_lock.RunLock(sys.argv[1], job="long-step", refresh_seconds=0.1)
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[2]))                 # one long step: nothing calls refresh()
lock.release()
"""


def test_a_lock_stays_held_through_a_step_longer_than_its_stale_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat refreshes the lock while the holder is busy, so a holder on another host
    whose step outlasts the stale limit is still alive to a second run (before the
    heartbeat, the lock was refreshed only between steps and was taken over here)."""
    monkeypatch.setattr(run_lock_module, "STALE_AFTER_SECONDS", 0.6)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), "3.0", RUN_LOCK_FILE],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(1.5)  # well past the stale limit since the lock was made
        with pytest.raises(RunDirInUse, match="host-a"):
            RunLock(tmp_path, job="second").acquire()
    finally:
        holder.wait(timeout=30)
    assert holder.returncode == 0
    assert not (tmp_path / LOCK_NAME).exists()


_RACER = _LOAD + """
import json, time
def slowly(write):                             # widen every window between deciding and writing
    def slow(*args, **kwargs):
        time.sleep(0.2)
        return write(*args, **kwargs)
    return slow
run_lock.json = type("SlowJson", (), {"dump": staticmethod(slowly(json.dump)),
                                      "dumps": staticmethod(slowly(json.dumps)),
                                      "loads": staticmethod(json.loads),
                                      "JSONDecodeError": json.JSONDecodeError})
lock = run_lock.RunLock(sys.argv[1], job="racer")
start = float(sys.argv[2])
while time.time() < start:
    pass
try:
    lock.acquire()
    print("won", flush=True)
    time.sleep(3.0)                            # hold it while the others look
    lock.release()
except run_lock.RunDirInUse:
    print("refused", flush=True)
"""


@pytest.mark.parametrize("stale_lock", [False, True], ids=["fresh", "stale"])
def test_of_racing_runs_exactly_one_takes_the_lock(tmp_path: Path, stale_lock: bool) -> None:
    """Runs started together on one run directory (empty, or with a dead run's lock): one
    wins, every other is refused. A racer never reads a half-written lock as unreadable,
    and never moves away a lock another racer has just taken."""
    racers = 6
    for round_ in range(2):
        run_dir = tmp_path / f"round-{round_}"
        run_dir.mkdir()
        if stale_lock:
            _write_lock(run_dir, pid=_dead_pid(), host=socket.gethostname())
        start = time.time() + 0.5
        procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(run_dir), str(start),
                                   RUN_LOCK_FILE],
                                  stdout=subprocess.PIPE, text=True) for _ in range(racers)]
        outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
        assert outcomes == ["refused"] * (racers - 1) + ["won"], outcomes
