"""Small training runs shared by the trainer tests: the options, and rank functions that the
gloo launcher runs in fresh processes (so they live in an importable module)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from ringray.model import model_preset
from ringray.train import (
    CheckpointStore,
    OptimizerOptions,
    ParallelOptions,
    Trainer,
    TrainingOptions,
    TrainOptions,
    run_training,
)
from ringray.train.sharding import full_tensor

TINY_MODEL = model_preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128)


def tiny_options(run_dir: str, **sections: dict) -> TrainOptions:
    """A two-layer model on 64-token sequences of the standard library, float32, SDPA.

    AdamW's eps is 1e-5, not 1e-8: the runs these options make are compared step by step,
    and an element whose gradient nearly cancels (1e-8, next to the usual 1e-3) moves by
    about ``lr * g / (|g| + eps)``, so a float32 summation-order difference of 3e-9 in it
    (another ring order, another sharding) moves it by up to ``lr * 3e-9 / eps``: 3e-3 with
    1e-8, 3e-6 with 1e-5. Which elements nearly cancel depends on the initial weights.

    ``sections`` change fields section by section, as a job spec would:
    ``tiny_options(d, parallel={"cp": 2}, train={"steps": 6})``.
    """
    base = TrainOptions(
        model=TINY_MODEL,
        parallel=ParallelOptions(attention_backend="sdpa"),
        train=TrainingOptions(
            seq_len=64, global_batch=2, steps=3, precision="fp32",
            optimizer=OptimizerOptions(lr=1e-2, warmup_steps=1, eps=1e-5),
            peak_tflops_per_device=1.0,  # a fixed peak: no matmul measurement in tests
        ),
        run_dir=run_dir,
    )
    return changed(base, **sections)


def changed(options: TrainOptions, **sections: dict) -> TrainOptions:
    """``options`` with some fields of some sections replaced (``parallel={"cp": 2}``)."""
    return replace(options, **{
        name: replace(getattr(options, name), **fields) if isinstance(fields, dict) else fields
        for name, fields in sections.items()
    })


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full weights (gathered from every rank's shard under FSDP: collective then)."""
    return {name: full_tensor(p.detach()).clone()
            for name, p in trainer.model.named_parameters()}


def gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full summed (and clipped) gradients, gathered like :func:`snapshot`."""
    return {name: full_tensor(p.grad.detach()).clone()
            for name, p in trainer.model.named_parameters()}


def record_steps(options: TrainOptions, steps: int) -> dict:
    """Losses, gradient norms (before clipping) and summed, clipped gradients of each step,
    and the final weights."""
    trainer = Trainer(options)
    losses, norms, grads = [], [], []
    for _ in range(steps):
        stats = trainer.step()
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        grads.append(gradients(trainer))
    return {"losses": losses, "grad_norms": norms, "grads": grads, "weights": snapshot(trainer)}


def rank_record_steps(rank: int, world: int, runs: list[TrainOptions], steps: int) -> list[dict]:
    return [record_steps(options, steps) for options in runs]


def rank_run_training(
    rank: int, world: int, runs: list[tuple[TrainOptions, int | None]]
) -> list[dict]:
    """``run_training`` for each (options, stop_after); the final weights of each run."""
    out = []
    for options, stop_after in runs:
        result = run_training(options, stop_after=stop_after, log=lambda _: None)
        trainer_weights = weights_from_checkpoint(options) if stop_after is None else None
        out.append({"resumed_from": result.resumed_from, "last_step": result.last_step,
                    "weights": trainer_weights})
    return out


def weights_from_checkpoint(options: TrainOptions) -> dict[str, torch.Tensor]:
    """The weights of the newest complete checkpoint, read back through a fresh trainer."""
    store = CheckpointStore(options.checkpoint_location)
    trainer = Trainer(changed(options, checkpoint={"resume": False}))
    trainer.load_checkpoint(store, store.latest())
    return snapshot(trainer)


def rank_crash_while_saving(rank: int, world: int, options: TrainOptions) -> None:
    """Checkpoint step 3, train to step 5, then die on rank 0 after every rank's shards of
    step 5 are written and before the commit marker is."""
    trainer = Trainer(options)
    store = CheckpointStore(options.checkpoint_location)
    for _ in range(3):
        trainer.step()
    trainer.save_checkpoint(store)
    for _ in range(2):
        trainer.step()
    if rank == 0:
        def die(*args, **kwargs):
            os._exit(17)

        store._write_marker = die  # the crash point: every shard written, no marker yet
    trainer.save_checkpoint(store)



def rank_record_steps_counting_reduce_scatters(
    rank: int, world: int, runs: list[TrainOptions], steps: int
) -> list[dict]:
    """:func:`rank_record_steps`, each run's record also holding ``reduce_scatters``: how
    many reduce-scatters (FSDP's gradient reductions) its steps issued, counted by a
    pass-through around ``torch.distributed.reduce_scatter_single``, which FSDP2 calls for
    each one (gathering weights and gradients for the record only all-gathers)."""
    import torch.distributed as dist

    real = dist.reduce_scatter_single
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    out = []
    dist.reduce_scatter_single = counted
    try:
        for options in runs:
            calls.clear()
            record = record_steps(options, steps)
            out.append({**record, "reduce_scatters": len(calls)})
    finally:
        dist.reduce_scatter_single = real
    return out
