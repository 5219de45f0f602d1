"""``ringray bench train`` runs a job spec per layout and reports what the issue asks for
(tokens/s, MFU, overlap, imbalance); on a machine without CUDA, ``--gpu`` says so."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ringray.cli import app


def test_bench_train_reports_every_layout_as_json() -> None:
    result = CliRunner().invoke(app, [
        "bench", "train", "--layouts", "zigzag,contiguous", "--steps", "1", "--warmup", "0",
        "--set", "parallel.cp=2", "--set", "train.seq_len=256", "--json",
    ])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout[result.stdout.index("["):])
    assert [r["layout"] for r in rows] == ["zigzag", "contiguous"]
    for row in rows:
        assert row["world"] == 2 and row["seq_len"] == 256 and row["measured_steps"] == 1
        assert row["tokens_per_second"] > 0 and row["mfu"] > 0
        assert row["load_imbalance"] >= 1.0


def test_bench_train_rejects_a_bad_override_by_name() -> None:
    result = CliRunner().invoke(app, ["bench", "train", "--set", "train.seq_len=100"])
    assert result.exit_code == 2
    assert "train.seq_len: 100 cannot be split" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, --gpu runs for real")
def test_bench_train_gpu_needs_cuda() -> None:
    result = CliRunner().invoke(app, ["bench", "train", "--gpu"])
    assert result.exit_code == 2 and "needs a GPU" in result.output
