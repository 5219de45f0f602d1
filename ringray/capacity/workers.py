"""Does one worker of a job fit the memory its node gives it? `ringray train` asks this before
it starts anything. A job that cannot fit is refused in one line, instead of its workers
growing until the operating system or Ray kills them.

    share = WorkerShare(node="this host's available memory", node_bytes=16 * GIB, workers=4)
    refusal = check_worker_memory(options, dp=1, cp=4, on_gpu=False, share=share)

The planned memory is the peak that `ringray plan` shows (:func:`~ringray.capacity.fit.
plan_footprint`, at the job's own mesh and the precision it will run at). A worker's share is
its node's memory divided by the workers on it, less :data:`~ringray.capacity.fit.
MEMORY_RESERVE_RATIO`. On GPUs each worker owns a device, so its share is that device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringray.accelerators import GIB
from ringray.capacity.fit import MEMORY_RESERVE_RATIO, plan_footprint, usable_bytes
from ringray.capacity.inputs import PlanInputs
from ringray.train import TrainOptions


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


def check_worker_memory(options: TrainOptions, *, dp: int, cp: int, on_gpu: bool,
                        share: WorkerShare) -> str | None:
    """``None`` when one worker's planned peak fits ``share``, else why it does not: one line
    with the figures and the ways out."""
    inputs = PlanInputs.of_mesh(options, dp=dp, cp=cp, name="job",
                                bf16=runs_bf16(options.train.precision, on_gpu=on_gpu))
    footprint = plan_footprint(inputs)
    usable = share.usable_bytes
    if footprint.peak_bytes <= usable:
        return None
    among = f" shared by {share.workers} workers" if share.workers > 1 else ""
    return (f"memory: one worker needs about {footprint.peak_bytes / GIB:.1f} GiB at its peak "
            f"({footprint.peak_moment}, seq {inputs.seq_len}, {inputs.local_batch} "
            f"sequence(s) per worker over cp={cp}; `ringray plan` shows the terms), more than "
            f"the {usable / GIB:.1f} GiB it has ({share.node}, {share.node_bytes / GIB:.1f} "
            f"GiB{among}, less {MEMORY_RESERVE_RATIO:.0%} reserve); lower train.seq_len or "
            f"train.global_batch, raise parallel.cp or set train.activation_checkpointing "
            f"(--force starts it anyway)")
