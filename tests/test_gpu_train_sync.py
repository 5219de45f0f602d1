"""On a CUDA GPU, a training step past the first synchronises the host with the device only
where it reads the step's statistics.

The trainer runs one step (kernels compile, caches fill: positions, tile lists, plans), then
two more under ``torch.cuda.set_sync_debug_mode("error")``, in which every synchronising
operation (a pageable host/device copy, ``.item()``, ``.tolist()``, a stream synchronise)
raises. The statistics of a step are read once, at its end, starting with
``RingStats.totals`` (which resolves the CUDA-event timers): the test lifts the error mode
there, so anything before it (batch upload, forward, backward, gradient clipping, AdamW)
must be sync-free. With packed documents every row brings new document lengths, whose
positions and document ids are uploaded through pinned memory without waiting.

Part of ``make gpu-check``; skipped without a GPU (``gpu`` marker, see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_a_training_step_has_no_hidden_sync(documents: bool) -> None:
    from ringray.data import DataOptions
    from ringray.model import model_preset
    from ringray.train import ParallelOptions, Trainer, TrainingOptions, TrainOptions

    trainer = Trainer(TrainOptions(
        model=model_preset("debug"),
        data=DataOptions(documents=documents),
        parallel=ParallelOptions(cp=1),
        train=TrainingOptions(seq_len=1024, global_batch=2, steps=4, precision="bf16"),
    ), device=torch.device("cuda"))
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
