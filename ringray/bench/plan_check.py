"""One rank of a big job on this one device, against what ``ringray plan`` says it holds.

    options = load_job_spec("jobs/llama-8b-1m-64xh100.yaml").train_options()
    row = check_rank_against_plan(options, job="llama-8b-1m", layers=2)

A 64-GPU job cannot run here, but one of its ranks can, nearly: this process joins PyTorch's
``fake`` process group as rank 1 of the job's world (every collective answers at once, and
received blocks keep whatever their buffers held), builds the job's model with only
``layers`` transformer blocks, and trains two steps on the job's own per-rank share of the
sequence (``seq_len / cp`` tokens per sequence) with FSDP sharding over the whole world as the
job does. The second step is measured: its wall time and its peak memory
(:func:`~ringray.bench.memory.step_peak_bytes`: ``max_memory_allocated`` on CUDA, the
allocator's own running total on CPU). The plan's figure is
:func:`~ringray.bench.memory.predicted_memory` for the same, shortened job: the memory model
``ringray plan`` puts against a device, and the one the GPU check holds to within 15 %.

``seq_scale`` divides the sequence (and the plan's with it) for a machine that cannot hold
the job's share: the CPU dry run of the GPU check uses it. It runs ``torch.distributed``
in this process, so a caller gives it a process of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ringray.bench.memory import predicted_memory, step_peak_bytes
from ringray.train import TrainOptions

PLAN_TOLERANCE = 0.15
"""The plan agrees with the measured peak when ``|planned - measured| <= 15 %`` of it."""


@dataclass(frozen=True, kw_only=True)
class PlanCheckRow:
    job: str
    device: str
    layers: int
    world_size: int
    local_tokens: int
    step_seconds: float
    measured_peak_bytes: int
    planned_peak_bytes: int

    @property
    def error_ratio(self) -> float:
        """(planned - measured) / measured: above 0 the plan over-estimates."""
        return (self.planned_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def agrees(self) -> bool:
        return abs(self.error_ratio) <= PLAN_TOLERANCE


def shortened(options: TrainOptions, *, layers: int, seq_scale: int = 1) -> TrainOptions:
    """``options`` with ``layers`` transformer blocks and the sequence divided by
    ``seq_scale``."""
    train = options.train
    return replace(options, model=replace(options.model, n_layers=layers),
                   train=replace(train, seq_len=train.seq_len // seq_scale))


def check_rank_against_plan(options: TrainOptions, *, job: str, layers: int,
                            seq_scale: int = 1, device: torch.device | None = None,
                            rank: int = 1) -> PlanCheckRow:
    """Rank ``rank`` of the job ``options`` (named ``job``), shortened to ``layers`` blocks,
    for two steps over the fake backend on ``device`` (CUDA when there is one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ringray.train import Trainer
    from ringray.train.memory_check import runs_bf16

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = shortened(options, layers=layers, seq_scale=seq_scale)
    parallel = options.parallel
    world = parallel.dp * parallel.cp * parallel.dp_replicate
    if dist.is_initialized():
        raise RuntimeError("check_rank_against_plan: torch.distributed is already initialised "
                           "in this process; run it in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        trainer = Trainer(options, device=device)
        trainer.step()  # kernels compile, caches fill, AdamW makes its moments
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        peak, _ = step_peak_bytes(trainer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    planned = predicted_memory(options, bf16=runs_bf16(options.train.precision,
                                                       on_gpu=device.type == "cuda"))
    return PlanCheckRow(
        job=job,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        layers=layers, world_size=world,
        local_tokens=options.train.seq_len // parallel.cp, step_seconds=seconds,
        measured_peak_bytes=peak, planned_peak_bytes=planned.peak_bytes)
