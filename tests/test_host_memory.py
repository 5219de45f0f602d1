"""Freed tensors' host memory goes back to the system in the processes that train
(:mod:`ringray.train.host_memory`): glibc's moving mmap threshold is held, so tensors of
4 MiB and up are never carved from the heap, which keeps what they free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringray.train import host_memory

SCRIPT = r"""
import re, sys, torch
from ringray.train.host_memory import release_freed_memory

def rss_mib():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024

if sys.argv[1] == "held":
    assert release_freed_memory()
# One 24 MiB tensor freed: glibc would now serve everything below 24 MiB from the heap.
torch.ones(6 << 20).sum()
before = rss_mib()
# 48 tensors of 8 MiB, touched; all but the last freed (it pins the top of the heap).
tensors = [torch.ones(2 << 20) for _ in range(48)]
last = tensors.pop()
del tensors
print(rss_mib() - before)
"""


def _growth(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                           "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_tensors_leave_the_process_once_the_threshold_is_held() -> None:
    moving = _growth("moving")  # glibc as it starts: the freed 376 MiB stay in the heap
    held = _growth("held")
    assert moving > 250, moving  # the control: without the hold the memory stays
    assert held < 40, held  # with it only the live 8 MiB tensor remains


def test_a_users_own_setting_is_left_alone(monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.release_freed_memory() is False
