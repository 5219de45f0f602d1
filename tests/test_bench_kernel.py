"""``ringray bench kernel``: on CPU it says that speed needs a GPU and runs the kernels'
correctness smoke (Triton interpreter against the float64 reference), which passes for the
real kernels and fails, with exit code 1, for a broken one. On CUDA (tests marked ``gpu``)
the smoke runs the compiled kernels and the timing paths return sane figures."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ringray.cli import app

pytest.importorskip("triton")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU-only path")


@no_cuda
def test_cpu_runs_the_smoke_only_and_it_passes():
    result = CliRunner().invoke(app, ["bench", "kernel", "--json"])
    assert result.exit_code == 0, result.output
    assert "kernel speed needs a CUDA GPU" in result.output
    report = json.loads(result.stdout)
    assert set(report) == {"smoke"}
    rows = report["smoke"]
    assert len(rows) == 10 and all(r["passed"] for r in rows)
    assert {r["case"].split()[0] for r in rows} == {"fp32", "bf16"}
    for r in rows:
        assert set(r["max_errors"]) == {"out", "lse", "dq", "dk", "dv"}
        assert all(r["max_errors"][w] <= r["tolerances"][w] for w in r["max_errors"])


@no_cuda
def test_cpu_table_names_every_case():
    result = CliRunner().invoke(app, ["bench", "kernel"])
    assert result.exit_code == 0, result.output
    assert "fp32 causal striped 0<-1" in result.stdout
    assert result.stdout.count("pass") == 10 and "FAIL" not in result.stdout


@no_cuda
def test_smoke_fails_for_a_wrong_kernel(monkeypatch):
    """A forward that drops the last key of every block is caught, and the command exits 1."""
    from ringray.attention.backends import triton_forward

    real = triton_forward.block_forward

    def drops_a_key(q, k, v, q_pos, k_pos, **kwargs):
        return real(q, k[:, :, :-1], v[:, :, :-1], q_pos, k_pos[:-1], **kwargs)

    monkeypatch.setattr(triton_forward, "block_forward", drops_a_key)
    result = CliRunner().invoke(app, ["bench", "kernel"])
    assert result.exit_code == 1
    assert "FAIL" in result.stdout and "the correctness smoke failed" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seqs", "4k"], "--seqs: expected comma-separated positive integers, got '4k'"),
        (["--seqs", "4096,,8192"], "--seqs: expected comma-separated positive integers, got "
                                   "'4096,,8192'"),
        (["--kv-heads", "3"], "--kv-heads: 3 must divide --heads 16"),
        (["--dtype", "float32"], "--dtype: 'float32' is not one of bfloat16, float16"),
        (["--seqs", "100", "--blocks", "4"], "--seqs/--blocks: layout: seq_len=100"),
    ],
)
def test_bad_flags_fail_with_one_line(args, message):
    result = CliRunner().invoke(app, ["bench", "kernel", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_causal_flops_count_half():
    from ringray.bench.kernel import attention_flops

    full = attention_flops(1, 16, 8192, 128, causal=False)
    assert full == 4 * 16 * 8192**2 * 128
    assert attention_flops(1, 16, 8192, 128, causal=True) == full / 2


@pytest.mark.gpu
def test_gpu_smoke_runs_the_compiled_kernels():
    from ringray.bench.kernel import run_smoke

    rows = run_smoke(torch.device("cuda"))
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]


@pytest.mark.gpu
def test_gpu_timings_are_sane():
    from ringray.bench.kernel import KernelBenchConfig, run_speed, run_virtual_ring

    cfg = KernelBenchConfig(seqs=(1024,), heads=4, kv_heads=2, head_dim=64, ring_blocks=2,
                            warmup=1, iters=2)
    speed = run_speed(cfg)
    assert {r.impl for r in speed} >= {"triton", "sdpa-flash"}
    assert all(r.forward_tflops > 0 and r.backward_tflops > 0 for r in speed)
    ring = run_virtual_ring(cfg)
    assert len(ring) == 2 and all(r.forward_ratio > 0 and r.backward_ratio > 0 for r in ring)
