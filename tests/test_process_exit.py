"""A process that used ring attention's agreement exits cleanly after
``destroy_process_group``: no module of ringray keeps a gloo group alive into interpreter
finalisation, where destroying it aborts the process ("terminate called without an active
exception", exit -6; seen in CI as a torchrun job failing after its last step)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import torch
import torch.distributed as dist
from ringray.attention.comm import agree_max

dist.init_process_group("gloo")
for _ in range(3):
    agree_max(torch.tensor([dist.get_rank()]), None)
dist.destroy_process_group()
print("done", flush=True)
"""


def test_ranks_that_agreed_exit_cleanly_after_destroying_their_groups(tmp_path: Path) -> None:
    script = tmp_path / "agree_and_exit.py"
    script.write_text(PROGRAM)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("done") == 2
