"""``ringray bench train``: tokens/s, MFU, overlap and load imbalance of a training job.

Runs a job (the CLI loads its spec, default ``jobs/quickstart.yaml``, once per layout) for a
few steps per layout, side by side in one invocation, on local gloo processes (one per rank of
the ``dp × cp`` mesh, one torch thread each), and reports the median over the measured steps
(the first ``warmup`` steps are dropped). No checkpoints are written.

``--gpu`` instead runs one process on the current CUDA device: the ``1b`` preset at long
context (16k by default) with activation checkpointing and bf16 autocast, reporting MFU
against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import torch

from ringray.bench.gloo_ranks import run_gloo_ranks
from ringray.model import model_preset
from ringray.train import (
    CheckpointOptions,
    ParallelOptions,
    StepStats,
    Trainer,
    TrainingOptions,
    TrainOptions,
)
from ringray.train.trainer import device_peak_flops


@dataclass(frozen=True, kw_only=True)
class TrainBenchResult:
    layout: str
    world: int
    seq_len: int
    global_batch: int
    tokens_per_second: float
    step_seconds: float
    mfu: float | None
    overlap_ratio: float
    load_imbalance: float
    peak_memory_bytes: int
    measured_steps: int


def summarize(
    layout: str, world: int, options: TrainOptions, stats: list[dict]
) -> TrainBenchResult:
    rows = [StepStats(**s) for s in stats]
    mfus = [r.mfu for r in rows if r.mfu is not None]
    return TrainBenchResult(
        layout=layout,
        world=world,
        seq_len=options.train.seq_len,
        global_batch=options.train.global_batch,
        tokens_per_second=statistics.median([r.tokens_per_second for r in rows]),
        step_seconds=statistics.median([r.step_seconds for r in rows]),
        mfu=statistics.median(mfus) if mfus else None,
        overlap_ratio=statistics.median([r.overlap_ratio for r in rows]),
        load_imbalance=statistics.median([r.load_imbalance for r in rows]),
        peak_memory_bytes=max(r.peak_memory_bytes for r in rows),
        measured_steps=len(rows),
    )


def _measure(options: TrainOptions, steps: int, warmup: int) -> list[dict]:
    trainer = Trainer(options)
    stats = [trainer.step() for _ in range(warmup + steps)]
    return [s.to_dict() for s in stats[warmup:]]


def _rank_main(rank: int, world: int, runs: list[TrainOptions], steps: int, warmup: int):
    return [_measure(options, steps, warmup) for options in runs]


def run_train_bench(
    jobs: list[TrainOptions], *, steps: int, warmup: int
) -> list[TrainBenchResult]:
    """Each job's medians (every rank a local process); the jobs differ in their layout and
    share one mesh. No checkpoints are read or written."""
    # One peak for every layout, measured here before the ranks start (one thread, alone):
    # the MFU figures are then comparable side by side. With more ranks than cores, the
    # ceiling is cores / ranks.
    torch.set_num_threads(1)
    peak = device_peak_flops(torch.device("cpu"))
    runs = [
        replace(
            options, checkpoint=replace(options.checkpoint, resume=False),
            train=replace(options.train, peak_tflops_per_device=(
                options.train.peak_tflops_per_device or peak / 1e12)),
        )
        for options in jobs
    ]
    dp, cp = runs[0].parallel.dp, runs[0].parallel.cp
    if dp is None or cp is None:
        raise ValueError("parallel: the benchmark needs both dp and cp set in the spec")
    world = dp * cp
    per_rank = run_gloo_ranks(world, _rank_main, runs, steps, warmup, timeout_seconds=3600)
    return [
        summarize(options.parallel.layout, world, options, stats)
        for options, stats in zip(runs, per_rank[0], strict=True)
    ]


def run_gpu_bench(
    *, seq_len: int, steps: int, warmup: int, preset: str = "1b"
) -> TrainBenchResult:
    """One CUDA device: ``preset`` at ``seq_len`` with activation checkpointing and bf16."""
    if not torch.cuda.is_available():
        raise ValueError("--gpu: no CUDA device here; this measurement needs a GPU")
    options = TrainOptions(
        model=model_preset(preset),
        parallel=ParallelOptions(dp=1, cp=1),
        train=TrainingOptions(seq_len=seq_len, global_batch=1, steps=warmup + steps,
                              precision="bf16", activation_checkpointing="full"),
        checkpoint=CheckpointOptions(resume=False),
        run_dir="runs/bench-gpu",
    )
    return summarize("single GPU", 1, options, _measure(options, steps, warmup))
