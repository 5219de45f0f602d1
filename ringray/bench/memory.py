"""``ringray bench memory``: each rank's measured peak memory in a training step, against what
``ringray plan`` predicts for the same job (:func:`ringray.train.footprint.rank_footprint`,
the memory model the plan puts against a device).

    results = run_memory_bench([options_a, options_b], steps=1)   # local gloo ranks, CPU
    results[0].measured_bytes, results[0].predicted_bytes, results[0].error_ratio

A job runs for one warm-up step (AdamW creates its moments in the first), then each measured
step's peak is taken on every rank; the figure is the largest. What "peak" means:

- **CUDA**: ``torch.cuda.max_memory_allocated`` over the step (its counter is reset as the
  step starts): the bytes the caching allocator handed out, not what it reserved.
- **CPU**: the same quantity, from the allocator's own accounting. PyTorch's CPU allocator has
  no statistics API, but while the profiler records memory it reports every allocation and
  free with the running total of bytes allocated since profiling began; the step's peak is
  the largest running total plus the bytes already live when the step starts (weights,
  optimizer state and their shards, summed over their storages, with the gradients released
  just before). Peak RSS is not used: ``ru_maxrss`` is a high-water mark of the whole
  process (the interpreter, libraries, gloo's buffers, earlier steps) that never goes down,
  and it also counts memory malloc keeps after a free; it cannot isolate one step.

The prediction is the plan's peak for the job as the trainer runs it here (float32 on CPU,
bf16 compute on CUDA with ``precision: auto``); the plan's reserve for what it does not count
(the CUDA context, NCCL, fragmentation) plays no part.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, replace

import torch
from torch.profiler import ProfilerActivity, profile

from ringray.bench.gloo_ranks import run_gloo_ranks
from ringray.train import StepStats, Trainer, TrainOptions
from ringray.train.footprint import Footprint, rank_footprint
from ringray.train.sharding import local_tensor


@dataclass(frozen=True, kw_only=True)
class MemoryBenchResult:
    """One job's measured and predicted peak memory per rank."""

    label: str  # what distinguishes this job in the table (sharding, checkpointing)
    world: int
    seq_len: int
    local_tokens: int  # tokens per rank per step
    device: str
    measured_peak_bytes: list[int]  # per rank, global rank order
    predicted: dict  # the plan's Footprint, as a dict
    ring_bytes_sent: list[int]  # per rank, in the last measured step (K/V blocks and dK/dV)

    @property
    def measured_bytes(self) -> int:
        return max(self.measured_peak_bytes)

    @property
    def predicted_bytes(self) -> int:
        return int(self.predicted["peak_bytes"])

    @property
    def error_ratio(self) -> float:
        """(predicted - measured) / measured: above 0 the plan over-estimates."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def predicted_memory(options: TrainOptions, *, bf16: bool) -> Footprint:
    """The plan's memory of one rank of ``options`` (dp and cp set), at the precision the
    trainer resolved (``bf16``: bf16 compute)."""
    dp, cp, train = options.parallel.dp, options.parallel.cp, options.train
    replicas = options.parallel.dp_replicate
    return rank_footprint(
        options.model,
        local_tokens=train.global_batch // (dp * replicas) * (train.seq_len // cp), cp=cp,
        shards=dp * cp if options.parallel.fsdp else 1, bf16=bf16,
        checkpointing=train.activation_checkpointing, ranks=dp * cp,
        foreach=torch.cuda.is_available())


def live_tensor_bytes(trainer: Trainer) -> int:
    """Bytes of the distinct storages behind the weights (this rank's shards under FSDP), the
    gradients and the optimizer state."""
    tensors = [local_tensor(p) for p in trainer.model.parameters()]
    tensors += [local_tensor(p.grad) for p in trainer.model.parameters() if p.grad is not None]
    for state in trainer.optimizer.state.values():
        tensors += [local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _peak_allocated(prof: profile) -> int:
    """The most CPU bytes allocated at once during the profile, above what was allocated when
    it began. The allocator's running total is process-wide and outlives a profile (it also
    keeps counting blocks whose free happened while no profile ran), so the total at the
    first event, less that event's own size, is the zero."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        kind, fields = node.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    if not events:
        return 0
    events.sort()
    _, first_size, first_total = events[0]
    return max(total for _, _, total in events) - (first_total - first_size)


def step_peak_bytes(trainer: Trainer) -> tuple[int, int]:
    """Run one step; return (its peak memory in bytes, ring bytes this rank sent)."""
    trainer.optimizer.zero_grad(set_to_none=True)  # freed here, not inside the measured step
    if trainer.device.type == "cuda":
        stats = trainer.step()  # resets the peak counter as it starts
        return torch.cuda.max_memory_allocated(trainer.device), _sent(trainer, stats)
    live = live_tensor_bytes(trainer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        stats = trainer.step()
    return live + _peak_allocated(prof), _sent(trainer, stats)


def _sent(trainer: Trainer, stats: StepStats) -> int:
    return stats.ring_bytes_sent[trainer.mesh.rank]


def measure_job(options: TrainOptions, *, steps: int) -> dict:
    """This rank's peaks over ``steps`` measured steps after one warm-up step (collective:
    every rank of the job calls it)."""
    trainer = Trainer(options)
    trainer.step()  # AdamW's moments are created here
    peaks, sent = zip(*(step_peak_bytes(trainer) for _ in range(steps)), strict=True)
    result = {"peak_bytes": max(peaks), "ring_bytes_sent": sent[-1],
              "bf16": trainer.compute_dtype is not None, "device": str(trainer.device)}
    del trainer
    gc.collect()
    return result


def _rank_main(rank: int, world: int, jobs: list[TrainOptions], steps: int) -> list[dict]:
    return [measure_job(options, steps=steps) for options in jobs]


def describe_job(options: TrainOptions) -> str:
    """``fsdp, selective``: what tells the jobs of one comparison apart."""
    sharding = "fsdp" if options.parallel.fsdp else "replicated"
    return f"{sharding}, {options.train.activation_checkpointing}"


def run_memory_bench(jobs: list[TrainOptions], *, steps: int = 1) -> list[MemoryBenchResult]:
    """Measure each job (all with the same dp × cp) on local gloo ranks on this machine's CPU,
    or in this process on one CUDA device (a one-rank job), and compare with the plan."""
    shapes = {(job.parallel.dp, job.parallel.cp) for job in jobs}
    if len(shapes) != 1 or None in next(iter(shapes)):
        raise ValueError("parallel: the benchmark needs dp and cp set, the same for every job")
    dp, cp = next(iter(shapes))
    world = dp * cp
    jobs = [replace(job, checkpoint=replace(job.checkpoint, resume=False)) for job in jobs]
    if torch.cuda.is_available():
        if world != 1:
            raise ValueError(f"parallel: on CUDA the benchmark runs one device (dp × cp = 1), "
                             f"got dp {dp} × cp {cp}")
        per_rank = [_rank_main(0, 1, jobs, steps)]
    else:
        per_rank = run_gloo_ranks(world, _rank_main, jobs, steps, timeout_seconds=3600)
    results = []
    for index, job in enumerate(jobs):
        rows = [rank_results[index] for rank_results in per_rank]
        predicted = predicted_memory(job, bf16=rows[0]["bf16"])
        results.append(MemoryBenchResult(
            label=describe_job(job), world=world, seq_len=job.train.seq_len,
            local_tokens=job.train.global_batch // dp * job.train.seq_len // cp,
            device=rows[0]["device"], measured_peak_bytes=[r["peak_bytes"] for r in rows],
            predicted=asdict(predicted),
            ring_bytes_sent=[r["ring_bytes_sent"] for r in rows],
        ))
    return results
