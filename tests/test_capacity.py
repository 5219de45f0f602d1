"""`ringray plan` (ringray/plan.py): the memory and overlap formulas against hand arithmetic and
against the tensors autograd really saves, the GPU job files' verdicts, and the command line.

(tests/test_plan.py is the attention step planner's, ringray/attention/plan.py.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from ringray.attention import make_layout
from ringray.capacity import (
    ACCELERATORS,
    GIB,
    PlanError,
    PlanInputs,
    activation_bytes_per_token,
    custom_cluster,
    head_activation_bytes_per_token,
    layer_activation_bytes_per_token,
    memory_breakdown,
    overlap_threshold_tokens,
    parse_cluster,
    plan,
    plan_job,
    ring_buffer_bytes_per_token,
)
from ringray.cli import app
from ringray.model import RingContext, Transformer, model_preset
from ringray.spec import load_job_spec, parse_job_spec

JOB_1B = "jobs/llama-1b-128k-h100.yaml"
JOB_8B = "jobs/llama-8b-1m-64xh100.yaml"

def _plan(spec, cluster):
    """``ringray plan`` for a spec: its training options, under its name."""
    return plan_job(spec.train_options(), cluster, name=spec.name)


def _inputs(spec, cluster):
    return PlanInputs.from_options(spec.train_options(), cluster, name=spec.name)



def small_inputs(**changes) -> PlanInputs:
    fields = dict(
        name="small", model=model_preset("debug", dim=256, n_layers=4, n_heads=8, n_kv_heads=2,
                                         ffn_hidden=512),
        seq_len=8192, global_batch=2, dp=1, cp=4, layout="zigzag", bf16=True,
        activation_checkpointing=False,
    )
    return PlanInputs(**{**fields, **changes})


def test_hand_computed_small_case():
    """dim d=256, 4 layers, h=8 query / k=2 kv heads (head_dim e=32), ffn f=512, vocab V=320;
    seq 8192 over cp=4, global batch 2, dp 1, bf16 (a=2); device 100 TFLOP/s, 100 Gb/s, 16 GiB.

    Per token, per layer:
      norms       2 x (4*256 + 4*256 + 4)             = 4104
      proj inputs (3 + 2) x 2 * 256                   = 2560
      attention   2*2*8*32 + 4*8 + 2*2*2*32           = 1024 + 32 + 256 = 1312
      SwiGLU      4 * 2 * 512                         = 4096
      layer                                           = 12072
    Head: (8*256 + 4) + 2*256 + (2 + 4)*320 + 8*32 + 16 = 2052 + 512 + 1920 + 256 + 16 = 4756
    Model, no checkpointing: 4 * 12072 + 4756 = 53044 bytes per token.
    Local tokens: 2 sequences x 8192 / 4 = 4096 -> activations 4096 * 53044 = 217_268_224 B.
    Ring buffers per token: backward 2 spare K/V blocks 2*(2*2*32)*2 = 512, three fp32 dK/dV
      3*(2*2*32)*4 = 1536, fp32 dQ 4*8*32 = 1024 -> 3072; x 4096 = 12_582_912 B.
    Parameters: per layer 256*32*(16+4) + 3*256*512 + 2*256 = 557_568; x4 + 256 + 2*320*256
      = 2_394_368; matmul ones (bf16 copies) 4*(163_840 + 393_216) + 320*256 = 2_310_144.
      weights 4*2_394_368 + 2*2_310_144 = 14_197_760; grads 9_577_472; AdamW 19_154_944.
    Peak = 42_930_176 + 217_268_224 + 12_582_912 = 272_781_312 B.
    Overlap: F/B = 1e14 / 12.5e9 = 8000 FLOP/B; forward 8000 * k a / (2 r h) with r = 1/2:
      8000 * 4 / 8 = 4000 tokens; backward 8000 * k (a+4) / (5 r h) = 8000 * 12 / 20 = 4800.
      The block is 8192 / 4 = 2048 tokens < 4800: communication exposed.
    """
    inputs = small_inputs()
    cfg = inputs.model
    assert layer_activation_bytes_per_token(cfg, bf16=True) == 12072
    assert head_activation_bytes_per_token(cfg, bf16=True) == 4756
    assert activation_bytes_per_token(cfg, bf16=True, checkpointing=False) == 53044
    assert ring_buffer_bytes_per_token(cfg, cp=4, bf16=True) == 3072
    assert cfg.num_params() == 2_394_368

    cluster = custom_cluster(tflops=100, link_gbps=100, memory_gib=16)
    memory = memory_breakdown(inputs, cluster.accelerator)
    assert memory.activations_bytes == 217_268_224
    assert memory.ring_buffers_bytes == 12_582_912
    assert (memory.weights_bytes, memory.gradients_bytes, memory.optimizer_bytes) == (
        14_197_760, 9_577_472, 19_154_944)
    assert memory.peak_bytes == 272_781_312
    assert memory.usable_bytes == int(16 * GIB * 0.9) and memory.fits

    forward, backward = overlap_threshold_tokens(
        cfg, peak_flops=100e12, link_bytes_per_second=12.5e9, bf16=True)
    assert forward == pytest.approx(4000) and backward == pytest.approx(4800)
    report = plan(inputs, cluster)
    assert report.overlap.block_tokens == 2048 and report.overlap.threshold_tokens == 4800
    assert not report.overlap.hidden and report.fits
    # cp 1 fits (4 x 53044 B per token x 16384 tokens = 0.9 GB) and needs no ring at all.
    assert report.recommended_cp == 1


def test_checkpointing_keeps_block_inputs_and_one_block():
    """With activation checkpointing: 4 layers x 4d (float32 block inputs) + one full block +
    the head = 4*1024 + 12072 + 4756 = 20924 bytes per token."""
    cfg = small_inputs().model
    assert activation_bytes_per_token(cfg, bf16=True, checkpointing=True) == 20924


def test_multi_head_causal_threshold_is_twice_f_over_b():
    """Ring Attention's rule: with k = h and bf16, full attention needs c >= F/B and causal
    (half of each block computed) c >= 2F/B in the forward pass."""
    cfg = model_preset("debug", n_heads=4, n_kv_heads=4)
    full, _ = overlap_threshold_tokens(cfg, peak_flops=1e15, link_bytes_per_second=1e11,
                                       bf16=True, causal=False)
    causal, _ = overlap_threshold_tokens(cfg, peak_flops=1e15, link_bytes_per_second=1e11,
                                         bf16=True)
    assert full == pytest.approx(1e4) and causal == pytest.approx(2e4)


def _saved_bytes_per_token(model: Transformer, seq: int, *, bf16: bool) -> float:
    """Bytes autograd saves for the backward (distinct storages, parameters excluded), for a
    forward and the trainer's loss over one sequence of ``seq`` tokens."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ring = RingContext(layout=make_layout("zigzag", 1, seq), backend="sdpa")
    tokens, labels = torch.randint(0, 256, (1, seq)), torch.randint(0, 256, (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens, ring)
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    return sum(saved.values())


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-autocast", "fp32"])
def test_activation_formula_matches_what_autograd_saves(bf16):
    """The per-token formula equals the bytes PyTorch's autograd keeps for the backward of
    this project's model (measured with saved-tensor hooks at two lengths, so the bf16
    weight copies, which do not grow with the sequence, cancel). The trainer also holds
    the logits (a*V per token), which autograd does not save."""
    cfg = model_preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    torch.manual_seed(0)
    model = Transformer(cfg)
    seq = 256
    measured = (_saved_bytes_per_token(model, 2 * seq, bf16=bf16)
                - _saved_bytes_per_token(model, seq, bf16=bf16)) / seq
    logits_held = (2 if bf16 else 4) * cfg.vocab_size
    expected = activation_bytes_per_token(cfg, bf16=bf16, checkpointing=False) - logits_held
    assert measured == expected


def test_1b_job_fits_one_h100_node():
    """jobs/llama-1b-128k-h100.yaml on 1x8xH100: 8 sequences x 16384 tokens per GPU with
    checkpointing: 16*4*2048 + 129160 (layer: 32776 + 20480 + 10368 + 65536) + 22932 (head)
    = 283164 B/token x 131072 tokens = 34.57 GiB of activations. Overlap on NVLink (450 GB/s
    one way): F/B = 989e12 / 450e9 = 2197.8; backward 2197.8 * 8 * 6 / (5 * 0.5 * 32) = 1318.7
    -> 1319 tokens, far below the 16384-token block."""
    report = _plan(load_job_spec(JOB_1B), parse_cluster("1x8xH100"))
    cfg = report.inputs.model
    assert layer_activation_bytes_per_token(cfg, bf16=True) == 129160
    assert head_activation_bytes_per_token(cfg, bf16=True) == 22932
    assert report.memory.activations_bytes == 283164 * 131072
    assert report.memory.activations_bytes / GIB == pytest.approx(34.57, abs=0.005)
    assert report.overlap.link == "NVLink"
    assert report.overlap.threshold_tokens == 1319
    assert math.ceil(report.overlap.forward_threshold_tokens) == 1099
    assert report.overlap.block_tokens == 16384 and report.overlap.hidden
    assert report.fits and report.verdict.startswith("fits: 53.9 GiB of 72.0 GiB")
    # cp 4 would hold twice the activations (69 GiB) and does not fit: 8 is the smallest.
    assert not memory_breakdown(report.inputs, ACCELERATORS["H100"], cp=4).fits
    assert report.recommended_cp == 8 and report.recommended_layout == "zigzag"


def test_8b_job_does_not_fit_replicated_weights():
    """jobs/llama-8b-1m-64xh100.yaml on 8x8xH100: the ring of 32 spans 4 nodes, so its step
    waits on InfiniBand (50 GB/s): F/B = 19780, backward threshold 19780 * 0.6 = 11868 tokens
    < the 32768-token block (hidden). But the trainer replicates fp32 weights (4 B), their
    bf16 copies (2 B per matmul parameter), gradients (4 B) and AdamW (8 B) on every GPU:
    about 117 GiB for 6.98B parameters, over the 72 GiB usable whatever cp is."""
    report = _plan(load_job_spec(JOB_8B), parse_cluster("8x8xH100"))
    params = report.inputs.model.num_params()
    assert report.overlap.link == "InfiniBand"
    assert report.overlap.threshold_tokens == 11868 and report.overlap.hidden
    assert report.memory.static_bytes > report.memory.usable_bytes
    assert report.memory.static_bytes / GIB == pytest.approx(117.0, abs=0.05)
    assert report.memory.static_bytes >= 16 * params
    assert report.memory.activations_bytes == 32768 * activation_bytes_per_token(
        report.inputs.model, bf16=True, checkpointing=True)
    assert not report.fits and report.recommended_cp is None
    assert "no sharding" in report.verdict and "45.0 GiB over" in report.verdict


def test_cluster_size_and_inferred_cp():
    spec = load_job_spec(JOB_1B, ["parallel.cp=null"])
    assert _inputs(spec, parse_cluster("2x8xH100")).cp == 16
    with pytest.raises(PlanError, match=r"parallel\.cp: null, and it cannot be inferred"):
        _inputs(spec, custom_cluster(tflops=1, link_gbps=1, memory_gib=1))
    report = _plan(load_job_spec(JOB_1B), parse_cluster("1x4xH100"))
    assert not report.fits and "dp 1 x cp 8 = 8 devices, the cluster has 4" in report.verdict


def test_contiguous_layout_is_flagged_and_zigzag_recommended():
    report = plan(small_inputs(layout="contiguous"),
                  custom_cluster(tflops=100, link_gbps=100, memory_gib=16))
    assert report.recommended_layout == "zigzag"
    assert "unbalanced" in report.layout_note and "1.75x" in report.layout_note


@pytest.mark.parametrize("text", ["8x8xh100", " 1 x 8 x H200 ", "2x8xA100"])
def test_parse_cluster_accepts_known_accelerators(text):
    cluster = parse_cluster(text)
    assert cluster.total_devices in (64, 8, 16)


def test_plan_json_matches_the_report():
    result = CliRunner().invoke(app, ["plan", JOB_1B, "--cluster", "1x8xH100", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    report = _plan(load_job_spec(JOB_1B), parse_cluster("1x8xH100"))
    assert data == json.loads(json.dumps(report.to_dict()))
    assert data["fits"] is True and data["overlap"]["threshold_tokens"] == 1319
    assert data["memory"]["activations_bytes"] == 283164 * 131072


def test_plan_text_and_exit_code_one_when_it_does_not_fit():
    """8b at 1M tokens with cp=1 on one H100: activations alone are terabytes."""
    result = CliRunner().invoke(app, [
        "plan", JOB_8B, "--cluster", "1x1xH100",
        "--set", "parallel.cp=1", "--set", "parallel.dp=1", "--set", "train.global_batch=1",
    ])
    assert result.exit_code == 1, result.output
    assert "verdict: does not fit" in result.stdout and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["plan", JOB_8B, "--cluster", "8x8xH100"])
    assert result.exit_code == 1 and "recommended: no cp fits" in result.stdout
    result = CliRunner().invoke(app, ["plan", JOB_1B, "--cluster", "1x8xH100"])
    assert result.exit_code == 0 and "verdict: fits" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--cluster", "4by8"], "--cluster: '4by8' is not of the form NODESxGPUSxACCELERATOR"),
    (["--cluster", "4x8xV100"], "--cluster: unknown accelerator 'V100'; known: H100, H200, A100"),
    (["--cluster", "0x8xH100"], "--cluster: '0x8xH100' needs at least 1 node"),
    ([], "--cluster: required, e.g. 4x8xH100"),
    (["--gpu-tflops", "300"], "missing: --link-gbps, --gpu-mem-gib"),
    (["--cluster", "1x8xH100", "--gpu-mem-gib", "80"], "not both"),
    (["--gpu-tflops", "0", "--link-gbps", "1", "--gpu-mem-gib", "1"],
     "--gpu-tflops: must be > 0"),
    (["--cluster", "1x8xH100", "--set", "parallel.cp=3"], "train.seq_len: 131072 cannot be split"),
])
def test_plan_usage_errors_are_one_line(args, message):
    result = CliRunner().invoke(app, ["plan", JOB_1B, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_plan_reads_a_spec_dict_too():
    """The planner takes any validated spec (not only files)."""
    spec = parse_job_spec({"model": {"preset": "small"}, "parallel": {"cp": 2},
                           "train": {"seq_len": 4096, "global_batch": 2}})
    report = _plan(spec, parse_cluster("1x2xA100"))
    assert report.fits and report.overlap.link == "NVLink"
