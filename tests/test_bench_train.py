"""``ringray bench train`` runs a job spec per layout and reports what the issue asks for
(tokens/s, MFU, overlap, imbalance); on a machine without CUDA, ``--gpu`` says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ringray.cli import app
from ringray.model import Transformer
from ringray.spec import load_job_spec

QUICKSTART = Path(__file__).resolve().parents[1] / "jobs" / "quickstart.yaml"


def test_bench_train_reports_every_layout_as_json() -> None:
    """Each layout's row holds what its name says: tokens/s is the global batch's tokens over
    the step's seconds; MFU is model FLOPs per second over the peak of every rank, with the
    FLOPs counted from the model torch builds (6 per weight and token, causal attention
    half of 4·seq·heads·head_dim per layer, three times for forward and backward); overlap
    in [0, 1]; imbalance a max over a mean."""
    peak_tflops = 0.001  # a fixed peak, so MFU follows from tokens/s alone
    result = CliRunner().invoke(app, [
        "bench", "train", "--layouts", "zigzag,contiguous", "--steps", "1", "--warmup", "0",
        "--set", "parallel.cp=2", "--set", "train.seq_len=256",
        "--set", f"train.peak_tflops_per_device={peak_tflops}", "--json",
    ])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout[result.stdout.index("["):])
    assert [r["layout"] for r in rows] == ["zigzag", "contiguous"]

    config = load_job_spec(str(QUICKSTART)).train_options().model  # the default job's
    model = Transformer(config)
    weights = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    attention = 3 * 0.5 * 4 * 256 * config.n_heads * config.head_dim * config.n_layers
    flops_per_token = 6 * weights + attention
    for row in rows:
        assert row["world"] == 2 and row["seq_len"] == 256 and row["measured_steps"] == 1
        tokens = row["global_batch"] * row["seq_len"]
        assert row["step_seconds"] > 0
        assert row["tokens_per_second"] == pytest.approx(tokens / row["step_seconds"], rel=1e-9)
        assert row["mfu"] == pytest.approx(
            row["tokens_per_second"] * flops_per_token / (2 * peak_tflops * 1e12), rel=1e-9)
        assert 0.0 <= row["overlap_ratio"] <= 1.0
        assert row["load_imbalance"] >= 1.0


def test_bench_train_rejects_a_bad_override_by_name() -> None:
    result = CliRunner().invoke(app, ["bench", "train", "--set", "train.seq_len=100"])
    assert result.exit_code == 2
    assert "train.seq_len: 100 cannot be split" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, --gpu runs for real")
def test_bench_train_gpu_needs_cuda() -> None:
    result = CliRunner().invoke(app, ["bench", "train", "--gpu"])
    assert result.exit_code == 2 and "needs a GPU" in result.output
