"""Waiting for a command by its progress, not by a fixed time (issue 40: fixed 60 s and
150 s waits failed under a load of 12-19 on 2 cores, and 180 s and 240 s ones at 5-7)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

STALL_SECONDS = 120.0
"""A command may take as long as it keeps making progress (its run directory's logs
growing); it fails only after this long without any, stretched by the load (``prompt``)."""


def prompt(seconds: float) -> float:
    """``seconds`` on a quiet machine, stretched by the load beyond the cores (a loaded CI
    machine runs every process that much slower; a test measures the design, not it)."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


class _Progress:
    """The run directory's ``*.jsonl`` files, their names and sizes: progress is any change."""

    def __init__(self, run_dir: Path, stall_seconds: float) -> None:
        self.run_dir, self.stall_seconds = run_dir, stall_seconds
        self.seen, self.since = self._now(), time.monotonic()

    def _now(self) -> tuple:
        return tuple(sorted((p.name, p.stat().st_size) for p in self.run_dir.glob("*.jsonl")))

    def stalled(self) -> bool:
        now = self._now()
        if now != self.seen:
            self.seen, self.since = now, time.monotonic()
        return time.monotonic() - self.since > prompt(self.stall_seconds)


def finish(proc: subprocess.Popen, run_dir: Path, *,
           stall_seconds: float = STALL_SECONDS) -> tuple[str, str]:
    """``proc.communicate()``, waiting while ``run_dir``'s ``*.jsonl`` files grow (or
    appear); raises ``AssertionError`` after ``stall_seconds`` without progress (the command
    is killed first)."""
    progress = _Progress(run_dir, stall_seconds)
    while True:
        try:
            return proc.communicate(timeout=2)  # a retry after a timeout loses no output
        except subprocess.TimeoutExpired:
            if progress.stalled():
                proc.kill()
                _, err = proc.communicate()
                raise AssertionError(f"no progress in {run_dir} for {stall_seconds:.0f} s "
                                     f"(load-stretched): {err[-2000:]}") from None


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen, run_dir: Path,
               what: str, *, stall_seconds: float = STALL_SECONDS) -> None:
    """Returns once ``condition()`` holds; raises ``AssertionError`` if ``proc`` exits first
    (with its stderr), or after ``stall_seconds`` (load-stretched) without progress in
    ``run_dir``. The caller still owns ``proc``."""
    progress = _Progress(run_dir, stall_seconds)
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert not progress.stalled(), (
            f"no {what}: no progress in {run_dir} for {stall_seconds:.0f} s (load-stretched)")
        time.sleep(0.2)


def run(args: list[str], run_dir: Path, **popen: object) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True)`` for a command that writes
    ``run_dir``, waited for by its progress (``finish``) instead of a fixed timeout."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
    try:
        stdout, stderr = finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
