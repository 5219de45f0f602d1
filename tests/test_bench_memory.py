"""``ringray bench memory``: the measured peak memory of a training step against
``ringray plan``'s prediction, and what selective activation checkpointing buys.

One launch of two gloo ranks (cp 2) runs the debug model at 2048 tokens per rank six ways
(replicated and FSDP × no, full and selective checkpointing); the plan's peak is within 15%
of the measured one for each, selective checkpointing sends exactly the ring traffic of no
checkpointing (full sends every forward block twice) with a lower peak, and FSDP lowers the
peak of each mode.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ringray.bench.memory import MemoryBenchResult, run_memory_bench
from ringray.cli import app
from ringray.model import model_preset
from ringray.train import OptimizerOptions, ParallelOptions, TrainingOptions, TrainOptions

MODES = ("none", "full", "selective")
_cache: dict[str, MemoryBenchResult] = {}


def _job(fsdp: bool, mode: str, run_dir: str) -> TrainOptions:
    return TrainOptions(
        model=model_preset("debug"),
        parallel=ParallelOptions(dp=1, cp=2, attention_backend="sdpa", fsdp=fsdp),
        train=TrainingOptions(seq_len=2048, global_batch=2, steps=3, precision="fp32",
                              activation_checkpointing=mode, peak_tflops_per_device=1.0,
                              optimizer=OptimizerOptions(lr=1e-3, warmup_steps=1)),
        run_dir=run_dir,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, MemoryBenchResult]:
    if not _cache:
        run_dir = str(tmp_path_factory.mktemp("memory"))
        jobs = [_job(fsdp, mode, run_dir) for fsdp in (False, True) for mode in MODES]
        _cache.update({r.label: r for r in run_memory_bench(jobs, steps=1)})
    return _cache


@pytest.mark.parametrize("sharding", ["replicated", "fsdp"])
@pytest.mark.parametrize("mode", MODES)
def test_plan_predicts_the_measured_peak(results, sharding: str, mode: str) -> None:
    """Within 15% on every rank's peak (the largest is compared)."""
    result = results[f"{sharding}, {mode}"]
    assert abs(result.error_ratio) <= 0.15, (result.measured_bytes, result.predicted_bytes)


@pytest.mark.parametrize("sharding", ["replicated", "fsdp"])
def test_selective_checkpointing_sends_no_block_twice(results, sharding: str) -> None:
    """Per rank per step, cp 2, 2 layers: a K/V block is 2 (k, v) x 2 sequences x 1024
    tokens x 2 kv heads x 32 x 4 B = 1 MiB. Zigzag over 2 ranks: rank 0 holds chunks 0 and
    3, rank 1 chunks 1 and 2, so rank 1 reads half of rank 0's block (chunk 0) and rank 0
    all of rank 1's. Without checkpointing each layer sends the rows read forward and,
    backward, the float32 dK/dV rows of the other rank's block (that block is kept from the
    forward, :mod:`ringray.attention.transfers`): rank 0 half a block and one sum, rank 1 one
    block and half a sum, 1.5 MiB a layer each, 3 MiB a step. Selective checkpointing sends
    exactly that; full checkpointing repeats the forward's ring pass: 4 MiB (rank 0) and
    5 MiB (rank 1). Selective's peak is below no checkpointing's."""
    block = 2 * 2 * 1024 * 2 * 32 * 4
    none, full, selective = (results[f"{sharding}, {mode}"] for mode in MODES)
    assert none.ring_bytes_sent == selective.ring_bytes_sent == [2 * 3 * block // 2] * 2
    assert full.ring_bytes_sent == [2 * 4 * block // 2, 2 * 5 * block // 2]
    assert selective.measured_bytes < none.measured_bytes
    assert full.measured_bytes <= selective.measured_bytes


@pytest.mark.parametrize("mode", MODES)
def test_fsdp_lowers_the_peak(results, mode: str) -> None:
    assert results[f"fsdp, {mode}"].measured_bytes < results[f"replicated, {mode}"].measured_bytes


def test_bench_memory_command_prints_json() -> None:
    result = CliRunner().invoke(app, [
        "bench", "memory", "--set", "parallel.cp=2", "--set", "train.seq_len=256",
        "--checkpointing", "selective", "--sharding", "fsdp", "--json",
    ])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout[result.stdout.index("["):])
    assert row["label"] == "fsdp, selective" and row["world"] == 2
    assert len(row["measured_peak_bytes"]) == 2 and row["predicted_bytes"] > 0
    assert abs(row["error_ratio"]) < 1


def test_bench_memory_rejects_an_unknown_mode() -> None:
    result = CliRunner().invoke(app, ["bench", "memory", "--checkpointing", "some"])
    assert result.exit_code == 2
    assert "--checkpointing: 'some' is not a comma-separated list of none, full, selective" \
        in result.output
