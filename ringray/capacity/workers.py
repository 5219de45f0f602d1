"""Does one worker of a job fit the memory its node gives it? The check lives in
:mod:`ringray.train.memory_check`, where the Ray workers (``ringray.cluster``, which may not
import this package) ask it too; it is re-exported here under the names ``ringray plan``'s
callers use.

    share = WorkerShare(node="this host's available memory", node_bytes=16 * GIB, workers=4)
    refusal = check_worker_memory(options, dp=1, cp=4, on_gpu=False, share=share)

The planned memory is the peak that `ringray plan` shows (:func:`~ringray.capacity.fit.
plan_footprint`, at the job's own mesh and the precision it will run at). A worker's share is
its node's memory divided by the workers on it, less :data:`~ringray.capacity.fit.
MEMORY_RESERVE_RATIO`. On GPUs each worker owns a device, so its share is that device's memory.
"""

from __future__ import annotations

from ringray.train.memory_check import (
    WorkerShare,
    check_worker_memory,
    planned_footprint,
    runs_bf16,
)

__all__ = ["WorkerShare", "check_worker_memory", "planned_footprint", "runs_bf16"]
