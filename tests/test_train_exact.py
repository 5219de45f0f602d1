"""Context-parallel training is the same training as one device.

For each layout, CP=2 and CP=4 runs (real gloo processes) give the same per-step losses and
the same all-reduced gradients as a CP=1 run in this process, over three AdamW steps, and
DP=2 × CP=2 equals DP=1 × CP=1 with the same global batch. float32, SDPA kernel; tolerance
atol = rtol = 1e-5 on losses and gradients. The weights after the third step are checked at
atol 1e-4: AdamW divides each element's update by its own gradient scale, so for an element
whose gradient is ~0 a 1e-7 difference in the gradient becomes a visible share of lr.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_gloo_ranks
from train_cases import rank_record_steps, record_steps, tiny_options

LAYOUTS = ("zigzag", "striped", "contiguous")
STEPS = 3
TOL = {"atol": 1e-5, "rtol": 1e-5}
WEIGHT_TOL = {"atol": 1e-4, "rtol": 1e-5}
_cache: dict = {}


def _single_device(tmp_path_factory, global_batch: int) -> dict:
    key = ("single", global_batch)
    if key not in _cache:
        run_dir = str(tmp_path_factory.mktemp("single"))
        options = tiny_options(run_dir, parallel={"dp": 1, "cp": 1},
                               train={"global_batch": global_batch})
        _cache[key] = record_steps(options, STEPS)
    return _cache[key]


def _ring(tmp_path_factory, cp: int) -> dict[str, dict]:
    key = ("ring", cp)
    if key not in _cache:
        run_dir = str(tmp_path_factory.mktemp(f"cp{cp}"))
        runs = [tiny_options(run_dir, parallel={"dp": 1, "cp": cp, "layout": name})
                for name in LAYOUTS]
        per_rank = run_gloo_ranks(cp, rank_record_steps, runs, STEPS, timeout_seconds=300)
        _cache[key] = per_rank
    return _cache[key]


def _assert_same_training(got: dict, want: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL)
    for step, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        for name in w_step:
            torch.testing.assert_close(
                g_step[name], w_step[name], **TOL,
                msg=lambda m, n=name, s=step: f"{n} step {s}: {m}",
            )
    for name in want["weights"]:
        torch.testing.assert_close(got["weights"][name], want["weights"][name], **WEIGHT_TOL)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_equals_single_device(tmp_path_factory, layout: str, cp: int) -> None:
    """Every rank of the ring ends each step with the single-device gradients."""
    want = _single_device(tmp_path_factory, global_batch=2)
    per_rank = _ring(tmp_path_factory, cp)
    for rank_runs in per_rank:
        _assert_same_training(rank_runs[LAYOUTS.index(layout)], want)


def test_dp2_cp2_equals_single_device(tmp_path) -> None:
    """Two replicas of a 2-rank ring, 4 sequences per step, equal one device on the same 4."""
    want = _single_device_for(tmp_path, global_batch=4)
    options = tiny_options(str(tmp_path / "dp2cp2"), parallel={"dp": 2, "cp": 2},
                           train={"global_batch": 4})
    per_rank = run_gloo_ranks(4, rank_record_steps, [options], STEPS, timeout_seconds=300)
    for rank_runs in per_rank:
        _assert_same_training(rank_runs[0], want)


def _single_device_for(tmp_path, global_batch: int) -> dict:
    options = tiny_options(str(tmp_path / "single"), parallel={"dp": 1, "cp": 1},
                           train={"global_batch": global_batch})
    return record_steps(options, STEPS)


def test_training_lowers_the_loss(tmp_path_factory) -> None:
    """The runs compared above train for real (a test of the reference itself)."""
    losses = _single_device(tmp_path_factory, global_batch=2)["losses"]
    assert losses[-1] < losses[0] - 0.5
