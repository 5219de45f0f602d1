"""Does one worker of a job fit the memory its node gives it? Asked before a job starts, so
that a job that cannot fit is refused in one line instead of its workers growing until the
operating system or Ray kills them.

    share = WorkerShare(node="this host's available memory", node_bytes=16 * GIB, workers=4)
    refusal = check_worker_memory(options, dp=1, cp=4, on_gpu=False, share=share)

Two places ask (``train.memory_check`` or ``--force`` turns both off):

- ``ringray train`` before it starts an embedded Ray (:mod:`ringray.cli.train`): this host's
  available memory shared by every worker of the job.
- every Ray worker before its training session is built
  (:meth:`ringray.cluster.worker.TrainWorker.check_memory`), on the node it runs on: that
  node's available memory shared by the job's workers placed there, or its GPU's memory.
  This is the check for jobs on a cluster (``--address``, ``ringray submit``); a refusal is
  a ``ValueError``, which the controller does not retry.

The planned memory is the peak that ``ringray plan`` shows (:func:`planned_footprint`, the
same :func:`~ringray.train.footprint.rank_footprint` at the job's own mesh and the precision
it will run at). A worker's share is its node's memory divided by the workers on it, less
:data:`MEMORY_RESERVE_RATIO`. On GPUs each worker owns a device, so its share is that
device's memory.

A node's memory is Linux's ``MemAvailable``, capped by the process's cgroup limit (a
container's) when one is set; :data:`NODE_MEMORY_VARIABLE` in a node's environment (set where
``ray start`` runs, or in this shell for an embedded Ray) replaces it with a figure of one's
own (bytes): a node shared with other work, or a test that gives a node a small memory.

Pure apart from :func:`host_memory` (reads ``/proc`` and the environment); no Ray, so the
cluster layer and ``ringray.capacity`` both import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ringray.accelerators import GIB
from ringray.train.footprint import Footprint, rank_footprint
from ringray.train.options import TrainOptions

MEMORY_RESERVE_RATIO = 0.10
"""Share of device memory left for what the accounting does not count: the CUDA context,
NCCL's buffers, kernel workspaces and allocator fragmentation. A judgement, not a
measurement."""

NODE_MEMORY_VARIABLE = "RINGRAY_NODE_MEMORY_BYTES"
"""Environment variable: the host memory (bytes) ringray counts on for a node's workers, in
place of what the node reports as available."""


class WorkerMemoryRefused(ValueError):
    """A worker's planned peak exceeds its share of its node (one line; a ``ValueError``, so
    the controller fails the job instead of retrying it)."""


def usable_bytes(memory_bytes: float) -> int:
    """What a rank may plan to use of ``memory_bytes``: all but the reserve
    (:data:`MEMORY_RESERVE_RATIO`)."""
    return int(memory_bytes * (1 - MEMORY_RESERVE_RATIO))


def runs_bf16(precision: str, *, on_gpu: bool) -> bool:
    """Whether the trainer computes in bf16 at ``train.precision`` (auto: bf16 on a GPU,
    float32 on a CPU)."""
    return precision == "bf16" or (precision == "auto" and on_gpu)


@dataclass(frozen=True, kw_only=True)
class WorkerShare:
    """The memory that one worker may use on its node."""

    node: str  # what that memory is, for the message: "this host's available memory"
    node_bytes: int
    workers: int = 1  # workers sharing node_bytes (1: a device of its own)

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.node_bytes / self.workers)


def local_batch(options: TrainOptions, *, dp: int) -> int:
    """Sequences per worker and step: the global batch over dp (times the replica groups,
    ``parallel.dp_replicate``, each of which takes its own slices)."""
    return options.train.global_batch // (dp * options.parallel.dp_replicate)


def planned_footprint(options: TrainOptions, *, dp: int, cp: int, on_gpu: bool) -> Footprint:
    """One worker's memory at the mesh dp × cp (``parallel.ulysses`` ranks per Ulysses group)
    and the precision it runs at: what ``ringray plan`` counts (``plan_footprint``; with
    replica groups, each worker's share of the batch)."""
    train, parallel = options.train, options.parallel
    local_tokens = local_batch(options, dp=dp) * (train.seq_len // cp)
    return rank_footprint(
        options.model, local_tokens=local_tokens, cp=cp,
        shards=dp * cp if parallel.fsdp else 1,
        bf16=runs_bf16(train.precision, on_gpu=on_gpu),
        checkpointing=train.activation_checkpointing, ulysses=parallel.ulysses,
        ranks=dp * cp, foreach=on_gpu)


def check_worker_memory(options: TrainOptions, *, dp: int, cp: int, on_gpu: bool,
                        share: WorkerShare) -> str | None:
    """``None`` when one worker's planned peak fits ``share``, else why it does not: one line
    with the figures and the ways out."""
    footprint = planned_footprint(options, dp=dp, cp=cp, on_gpu=on_gpu)
    usable = share.usable_bytes
    if footprint.peak_bytes <= usable:
        return None
    train = options.train
    among = f" shared by {share.workers} workers" if share.workers > 1 else ""
    return (f"memory: one worker needs about {size(footprint.peak_bytes)} at its peak "
            f"({footprint.peak_moment}, seq {train.seq_len}, {local_batch(options, dp=dp)} "
            f"sequence(s) per worker over cp={cp}; `ringray plan` shows the terms), more than "
            f"the {size(usable)} it has ({share.node}, {size(share.node_bytes)}"
            f"{among}, less {MEMORY_RESERVE_RATIO:.0%} reserve); lower train.seq_len or "
            f"train.global_batch, raise parallel.cp or set train.activation_checkpointing "
            f"(--force starts it anyway)")


def size(n: float) -> str:
    """Bytes for a message: GiB from 1 GiB up, else MiB (a small job on a small share
    would read "0.0 GiB")."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def host_memory(where: str) -> tuple[str, int]:
    """What this host gives new processes, as (its description for a message, bytes):
    :data:`NODE_MEMORY_VARIABLE` when set, else :func:`available_memory_bytes`. ``where``
    names the host ("this host", "node 1a2b3c4d"). Raises ``ValueError`` for a variable that
    is not a positive number of bytes."""
    value = os.environ.get(NODE_MEMORY_VARIABLE)
    if value is None:
        return f"{where}'s available memory", available_memory_bytes()
    try:
        node_bytes = int(value)
    except ValueError:
        node_bytes = 0
    if node_bytes <= 0:
        raise ValueError(f"{NODE_MEMORY_VARIABLE}: {value!r} on {where} is not a positive "
                         f"number of bytes; give one (e.g. {64 * GIB}), or unset it")
    return f"{where}'s memory as {NODE_MEMORY_VARIABLE} gives it", node_bytes


def available_memory_bytes() -> int:
    """Memory that new processes on this host can have: Linux's MemAvailable, capped by this
    process's cgroup limit (a container's) when one is set."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available
