"""``ringray bench train``: tokens/s, MFU, overlap and load imbalance of a training job.

Runs a job spec (default: ``jobs/quickstart.yaml``) for a few steps once per layout, side by
side in one invocation, on local gloo processes (one per rank of the spec's ``dp × cp``
mesh, one torch thread each), and reports the median over the measured steps (the first
``warmup`` steps are dropped). No checkpoints are written.

``--gpu`` instead runs one process on the current CUDA device: the ``1b`` preset at long
context (16k by default) with activation checkpointing and bf16 autocast, reporting MFU
against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import torch

from ringray.bench.launch import run_gloo_ranks
from ringray.config import load_job_spec
from ringray.model import model_preset
from ringray.train import StepStats, Trainer, TrainOptions
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
        seq_len=options.seq_len,
        global_batch=options.global_batch,
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
    config: str, *, layouts: tuple[str, ...], steps: int, warmup: int,
    overrides: tuple[str, ...] = (),
) -> list[TrainBenchResult]:
    """Each layout's medians for the job spec at ``config`` (every rank a local process)."""
    # One peak for every layout, measured here before the ranks start (one thread, alone):
    # the MFU figures are then comparable side by side. With more ranks than cores, the
    # ceiling is cores / ranks.
    torch.set_num_threads(1)
    peak = device_peak_flops(torch.device("cpu"))
    runs = []
    for layout in layouts:
        spec = load_job_spec(config, [*overrides, f"parallel.layout={layout}"])
        options = spec.train_options()
        runs.append(replace(
            options, resume=False,
            peak_flops_per_device=options.peak_flops_per_device or peak,
        ))
    dp, cp = runs[0].dp, runs[0].cp
    if dp is None or cp is None:
        raise ValueError("parallel: the benchmark needs both dp and cp set in the spec")
    world = dp * cp
    per_rank = run_gloo_ranks(world, _rank_main, runs, steps, warmup, timeout_seconds=3600)
    return [
        summarize(layout, world, options, stats)
        for layout, options, stats in zip(layouts, runs, per_rank[0], strict=True)
    ]


def run_gpu_bench(
    *, seq_len: int, steps: int, warmup: int, preset: str = "1b"
) -> TrainBenchResult:
    """One CUDA device: ``preset`` at ``seq_len`` with activation checkpointing and bf16."""
    if not torch.cuda.is_available():
        raise ValueError("--gpu: no CUDA device here; this measurement needs a GPU")
    options = TrainOptions(
        model=model_preset(preset), seq_len=seq_len, global_batch=1, steps=warmup + steps,
        dp=1, cp=1, precision="bf16", activation_checkpointing=True,
        run_dir="runs/bench-gpu", resume=False,
    )
    return summarize("single GPU", 1, options, _measure(options, steps, warmup))
