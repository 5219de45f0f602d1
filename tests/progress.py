"""Waiting for a command by its progress, not by a fixed time (issue 40: fixed 60 s and
150 s waits failed under a load of 12-19 on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

STALL_SECONDS = 120.0
"""A command may take as long as it keeps making progress (its run directory's logs
growing); it fails only after this long without any."""


def finish(proc: subprocess.Popen, run_dir: Path, *,
           stall_seconds: float = STALL_SECONDS) -> tuple[str, str]:
    """``proc.communicate()``, waiting while ``run_dir``'s ``*.jsonl`` files grow (or
    appear); raises ``AssertionError`` after ``stall_seconds`` without progress (the command
    is killed first)."""

    def progress() -> tuple:
        return tuple(sorted((p.name, p.stat().st_size) for p in run_dir.glob("*.jsonl")))

    seen, since = progress(), time.monotonic()
    while True:
        try:
            return proc.communicate(timeout=2)  # a retry after a timeout loses no output
        except subprocess.TimeoutExpired:
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > stall_seconds:
                proc.kill()
                _, err = proc.communicate()
                raise AssertionError(f"no progress in {run_dir} for {stall_seconds:.0f} s: "
                                     f"{err[-2000:]}") from None


def prompt(seconds: float) -> float:
    """``seconds`` on a quiet machine, stretched by the load beyond the cores (a loaded CI
    machine runs every process that much slower; a test measures the design, not it)."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
