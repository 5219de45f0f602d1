"""On a CUDA GPU, a training step past the first synchronises the host with the device only
where it reads the step's statistics: in one process (cp = 1), and as one rank of a ring,
Ulysses or FSDP job (cp > 1).

The trainer runs one step (kernels compile, caches fill: positions, tile lists, plans), then
two more under ``torch.cuda.set_sync_debug_mode("error")``, in which every synchronising
operation (a pageable host/device copy, ``.item()``, ``.tolist()``, a stream synchronise)
raises. The statistics of a step are read once, at its end, starting with
``RingStats.totals`` (which resolves the CUDA-event timers): the test lifts the error mode
there, so anything before it (batch upload, forward, backward, gradient clipping, AdamW)
must be sync-free. With packed documents every row brings new document lengths, whose
positions and document ids are uploaded through pinned memory without waiting.

One GPU holds one rank of a job (NCCL refuses two ranks on one device), so the cp > 1 cases
run rank 1 of the job in this process over PyTorch's ``fake`` backend, which answers every
collective at once: the rank's whole step runs (layouts, transfer plans, the ring's
double-buffered exchange, Ulysses' all-to-alls, FSDP's gathers and reduce-scatters, the
agreement of arguments), with received blocks left as they were allocated. What is checked is
the host's waiting, not the values (the gloo tests check those). The same harness runs on CPU
in every ``make test`` (without the sync check), so a GPU session finds it working.

The ``gpu`` tests are part of ``make gpu-check``; skipped without a GPU (conftest.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

CASES = {
    # name: (parallel options, data.documents)
    "ring-zigzag": (dict(cp=4), False),
    "ring-balanced-documents": (dict(cp=4, layout="balanced"), True),
    "ring-whole-documents": (dict(cp=4, layout="whole"), True),
    "ulysses": (dict(cp=4, ulysses=2), True),
    "fsdp-dp2-cp2": (dict(dp=2, cp=2, fsdp=True), True),
}


def _trainer(device: torch.device, parallel: dict, documents: bool, *, seq_len: int,
             precision: str):
    from ringray.data import DataOptions
    from ringray.model import model_preset
    from ringray.train import ParallelOptions, Trainer, TrainingOptions, TrainOptions

    return Trainer(TrainOptions(
        model=model_preset("debug"),
        data=DataOptions(documents=documents),
        parallel=ParallelOptions(**parallel),
        train=TrainingOptions(seq_len=seq_len, global_batch=2 * parallel.get("dp", 1),
                              steps=4, precision=precision),
    ), device=device)


def _steps_without_sync(trainer) -> None:
    """One step, then two with every host/device synchronisation an error until the step
    reads its statistics."""
    trainer.step()  # compiles kernels and fills the caches

    totals = trainer.ring_stats.totals

    def read_statistics(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("default")  # from here on the step reads its figures
        return totals(*args, **kwargs)

    trainer.ring_stats.totals = read_statistics
    try:
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            stats = trainer.step()
            assert stats.loss == stats.loss  # not NaN
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.ring_stats.totals = totals


@contextmanager
def _fake_job(world_size: int, rank: int = 1) -> Iterator[None]:
    """This process as rank ``rank`` of a job of ``world_size`` over the fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _world(parallel: dict) -> int:
    return parallel.get("dp", 1) * parallel["cp"]


@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_a_training_step_has_no_hidden_sync(documents: bool) -> None:
    _steps_without_sync(_trainer(torch.device("cuda"), dict(cp=1), documents, seq_len=1024,
                                 precision="bf16"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_ring_ranks_training_step_has_no_hidden_sync(case: str) -> None:
    parallel, documents = CASES[case]
    with _fake_job(_world(parallel)):
        trainer = _trainer(torch.device("cuda"), parallel, documents,
                           seq_len=1024 * parallel["cp"], precision="bf16")
        _steps_without_sync(trainer)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fake_backend_runs_a_ring_ranks_steps_on_cpu(case: str) -> None:
    """The harness of the GPU test above, on CPU: rank 1 of the job builds its groups, lays
    out its rows and runs whole steps over the fake backend (gloo side groups cannot be made
    there; the agreement runs on the fake group itself)."""
    parallel, documents = CASES[case]
    with _fake_job(_world(parallel)):
        trainer = _trainer(torch.device("cpu"), parallel, documents,
                           seq_len=64 * parallel["cp"], precision="fp32")
        assert trainer.mesh.cp_rank == 1 % parallel["cp"]
        losses = [trainer.step().loss for _ in range(2)]
    assert all(math.isfinite(loss) for loss in losses)
    assert not dist.is_initialized()
