"""`ringray plan` (ringray/capacity/): the memory and overlap formulas against hand arithmetic
and against the tensors autograd really saves (and the allocator really holds), for every
activation checkpointing mode, replicated and FSDP; the GPU job files' verdicts; the command
line.

(tests/test_plan.py is the attention step planner's, ringray/attention/plan.py.)
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from allocations import allocation_events
from typer.testing import CliRunner

from ringray.attention import make_layout
from ringray.capacity import (
    GIB,
    PlanError,
    PlanInputs,
    a2a_bytes_per_layer,
    activation_bytes_per_token,
    custom_cluster,
    gathered_bytes,
    head_activation_bytes_per_token,
    kept_activation_bytes_per_token,
    layer_activation_bytes_per_token,
    memory_breakdown,
    overlap_check,
    overlap_threshold_tokens,
    parse_cluster,
    plan,
    plan_job,
    recommend_ulysses,
    ring_buffer_bytes_per_token,
    ulysses_options,
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
        activation_checkpointing="none",
    )
    return PlanInputs(**{**fields, **changes})


def test_hand_computed_small_case():
    """dim d=256, 4 layers, h=8 query / k=2 kv heads (head_dim e=32), ffn f=512, vocab V=320;
    seq 8192 over cp=4, global batch 2, dp 1, bf16 (a=2); device 100 TFLOP/s, 100 Gb/s, 16 GiB.

    Per token, per layer:
      norms       2 x (4*256 + 4*256 + 4)             = 4104
      proj inputs (3 + 2) x 2 * 256                   = 2560
      attention   2*2*8*32 + 4*8 + 2*2*2*32           = 1024 + 32 + 256 = 1312
                  + on a ring (cp 4 > 1) the last K/V block received, 2*2*2*32 = 256: 1568
      SwiGLU      4 * 2 * 512                         = 4096
      layer                                           = 12072 alone, 12328 on the ring
    Head (no logits): (8*256 + 4) + 2*256 + 8*32 + 16 = 2052 + 512 + 256 + 16 = 2836
    Model, no checkpointing: 4 * 12072 + 2836 = 51124 bytes per token alone; on the ring of 4,
    4 * 12328 + 2836 = 52148.
    Local tokens: 2 sequences x 8192 / 4 = 4096 -> activations 4096 * 52148 = 213_598_208 B.
    The loss's chunk (all 4096 tokens: fewer than 4096 a chunk): 12 * 320 * 4096 =
      15_728_640 B at the start of the backward.
    Ring buffers per token (a ring of 4): backward 2 received K/V blocks and the own block's
      rows gathered for a reader, 3*(2*2*32)*2 = 768, four fp32 dK/dV sums 4*(2*2*32)*4 =
      2048, fp32 dQ 4*8*32 = 1024, dq/dk/dv cast back to bf16 (8*32 + 2*2*32)*2 = 768 ->
      4608. On a GPU (the plan's device) receives may run a step ahead of the compute, one
      more buffer in each pool: 4*256 + 5*512 + 1024 + 768 = 5376; x 4096 = 22_020_096 B.
    Parameters: per layer 256*32*(16+4) + 3*256*512 + 2*256 = 557_568; x4 + 256 + 2*320*256
      = 2_394_368; matmul ones (bf16 copies) 4*(163_840 + 393_216) + 320*256 = 2_310_144.
      weights 4*2_394_368 + 2*2_310_144 = 14_197_760; grads 9_577_472; AdamW 19_154_944.
    Peak, at the backward's start (every activation; of the gradients only the root's 164_096
    and one block's 557_568 parameters', 4 B each: 2_886_656; the ring's buffers, larger
    than the loss chunk): 14_197_760 + 19_154_944 + 2_886_656 + 213_598_208 + 22_020_096 =
    271_857_664 B. (At its end: all 9_577_472 B of
    gradients, one block's 4096 x 12328 B of activations and the ring buffers, 78_947_328
    B, less. Without checkpointing the backward's working set is the ring's buffers.)
    Overlap: F/B = 1e14 / 12.5e9 = 8000 FLOP/B; forward 8000 * k a / (2 r h) with r = 1/2:
      8000 * 4 / 8 = 4000 tokens; backward 8000 * k (a+4) / (5 r h) = 8000 * 12 / 20 = 4800.
      The block is 8192 / 4 = 2048 tokens < 4800: communication exposed.
    """
    inputs = small_inputs()
    cfg = inputs.model
    assert layer_activation_bytes_per_token(cfg, bf16=True) == 12072
    assert head_activation_bytes_per_token(cfg, bf16=True) == 2836
    assert activation_bytes_per_token(cfg, bf16=True, checkpointing="none") == 51124
    assert layer_activation_bytes_per_token(cfg, bf16=True, ring=4) == 12328
    assert activation_bytes_per_token(cfg, bf16=True, checkpointing="none", ring=4) == 52148
    assert ring_buffer_bytes_per_token(cfg, cp=4, bf16=True) == 4608
    assert ring_buffer_bytes_per_token(cfg, cp=4, bf16=True, cuda=True) == 5376
    assert cfg.num_params() == 2_394_368

    cluster = custom_cluster(tflops=100, link_gbps=100, memory_gib=16)
    memory = memory_breakdown(inputs, cluster)
    assert memory.activations_bytes == 213_598_208
    assert memory.ring_buffers_bytes == 22_020_096
    assert memory.loss_chunk_bytes == 15_728_640
    assert (memory.weights_bytes, memory.gradients_bytes, memory.optimizer_bytes) == (
        14_197_760, 9_577_472, 19_154_944)
    assert memory.first_gradients_bytes == 2_886_656
    assert memory.last_block_kept_bytes == 4096 * 12328
    assert memory.backward_working_bytes == memory.ring_buffers_bytes  # nothing recomputed
    assert memory.peak_bytes == 271_857_664 and memory.peak_moment == "backward start"
    assert memory.usable_bytes == int(16 * GIB * 0.9) and memory.fits

    forward, backward = overlap_threshold_tokens(
        cfg, peak_flops=100e12, link_bytes_per_second=12.5e9, bf16=True)
    assert forward == pytest.approx(4000) and backward == pytest.approx(4800)
    report = plan(inputs, cluster)
    assert report.overlap.block_tokens == 2048 and report.overlap.threshold_tokens == 4800
    assert not report.overlap.hidden and report.fits
    # cp 1 fits (51124 B per token x 16384 tokens = 0.8 GB) and needs no ring at all.
    assert report.recommended_cp == 1


def test_checkpointing_keeps_block_inputs_and_one_block():
    """With full activation checkpointing: 4 layers x 4d (float32 block inputs) + one full
    block + the head = 4*1024 + 12072 + 2836 = 19004 bytes per token."""
    cfg = small_inputs().model
    assert activation_bytes_per_token(cfg, bf16=True, checkpointing="full") == 19004


def test_selective_checkpointing_keeps_the_ring_tensors_and_recomputes_one_region():
    """Selective: each block keeps its input (4d) and ring attention's q, output, LSE and K/V
    block (1312, as in the hand-computed case); the backward recomputes the larger region
    around the ring: before it, norm (2052) + q/k/v inputs (3*2*256) = 3588; after it, norm
    (2052) + w1/w3 inputs (2*2*256) + SwiGLU (4096) = 7172. 4*(1024 + 1312) + 7172 + 2836
    = 19352 bytes per token: between full (19004) and none (51124)."""
    cfg = small_inputs().model
    assert kept_activation_bytes_per_token(cfg, bf16=True, checkpointing="selective") == 12180
    assert activation_bytes_per_token(cfg, bf16=True, checkpointing="selective") == 19352


def test_backward_working_set_per_checkpointing_mode():
    """What a block's backward adds to the kept activations (4096 local tokens, ring buffers
    5376 B/token on a GPU; cp 4, so a block on the ring is 12328 and its ring part 1568):
    none, the ring buffers; full, the larger of the whole recomputed block (12328) and what
    stays of it through the ring's backward (before the ring 3588 + the ring's saved 1568)
    plus the buffers: max(12328, 10532) = 12328; selective, whose two
    regions are rebuilt before and after the ring's backward, not during it: max(7172,
    3588, 5376) = 7172."""
    cluster = parse_cluster("1x8xH100")
    working = {mode: memory_breakdown(small_inputs(activation_checkpointing=mode), cluster)
               .backward_working_bytes for mode in ("none", "full", "selective")}
    assert working == {"none": 4096 * 5376, "full": 4096 * 12328, "selective": 4096 * 7172}


def test_fsdp_divides_the_static_memory_and_adds_gathered_blocks():
    """The hand-computed case with FSDP over dp 1 x cp 4: the 2_394_368 parameters are
    598_592 per device (weights and gradients 4 B each, AdamW 8 B; no autocast copies: FSDP
    gathers bf16 weights), and the residual stream is bf16, so q/k/v and w1/w3 share one
    bf16 input each (a*d = 512): layer 12072 - (1536 + 1024 - 1024) = 10536, and on the ring
    of 4 one more K/V block (256), 10792; 4 * 10792 + 2836 = 46004 B per token x 4096 tokens
    = 188_432_384. Gathered (w = 2): the root (two 320 x
    256 tables and the final norm: 164_096) twice (weights, gradients), 656_384, plus one
    block's 557_568 x (2*2 + max(2, 4)) = 4_460_544. Peak, at the backward's start (the
    first gradients: 4 x 721_664 / 4 = 721_664; the ring's buffers on a GPU, 4096 x 5376 =
    22_020_096, larger than the loss chunk): 2_394_368 + 4_788_736 + 721_664 + 188_432_384
    + 22_020_096 + 5_116_928 = 223_474_176 B."""
    inputs = small_inputs(fsdp=True)
    cfg = inputs.model
    assert layer_activation_bytes_per_token(cfg, bf16=True, bf16_weights=True) == 10536
    assert gathered_bytes(cfg, bf16=True) == 5_116_928
    memory = memory_breakdown(inputs, custom_cluster(tflops=100, link_gbps=100,
                                                     memory_gib=16))
    assert (memory.weights_bytes, memory.gradients_bytes, memory.optimizer_bytes) == (
        2_394_368, 2_394_368, 4_788_736)
    assert memory.activations_bytes == 188_432_384
    assert memory.gathered_bytes == 5_116_928
    assert memory.peak_bytes == 223_474_176
    # One device shards nothing: FSDP is then the replicated run (autocast, no gathering).
    h100 = parse_cluster("1x8xH100")
    alone = memory_breakdown(small_inputs(fsdp=True, cp=1), h100)
    assert alone == memory_breakdown(small_inputs(cp=1), h100)


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
            model(tokens, ring, labels=labels)  # the trainer's loss: chunked, checkpointed
    return sum(saved.values())


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-autocast", "fp32"])
def test_activation_formula_matches_what_autograd_saves(bf16):
    """The per-token formula equals the bytes PyTorch's autograd keeps for the backward of
    this project's model (measured with saved-tensor hooks at two lengths, so the bf16
    weight copies, which do not grow with the sequence, cancel). No logits: the loss's
    checkpoints save each chunk's input (the final norm's output) and nothing of the
    vocabulary's size."""
    cfg = model_preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    torch.manual_seed(0)
    model = Transformer(cfg)
    seq = 256
    measured = (_saved_bytes_per_token(model, 2 * seq, bf16=bf16)
                - _saved_bytes_per_token(model, seq, bf16=bf16)) / seq
    assert measured == activation_bytes_per_token(cfg, bf16=bf16, checkpointing="none")


def _live_after_forward_bytes(model: Transformer, seq: int, *, autocast: bool) -> int:
    """Bytes the CPU allocator holds after a forward and the trainer's loss over one sequence
    of ``seq`` tokens, of what was allocated from the tokens on (parameters excluded): what
    the forward leaves for the backward, whatever keeps it (autograd's saved tensors, the
    checkpoints' inputs, the logits). From the profiler's running total of allocated bytes
    (see ringray/bench/memory.py)."""
    from torch.profiler import ProfilerActivity, profile

    ring = RingContext(layout=make_layout("zigzag", 1, seq), backend="sdpa")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tokens, labels = torch.randint(0, 256, (1, seq)), torch.randint(0, 256, (1, seq))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, ring, labels=labels)  # the trainer's loss
    events = allocation_events(prof)
    (_, first_size, first_total), (_, _, last_total) = events[0], events[-1]
    del loss
    return last_total - (first_total - first_size)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights"])
def test_kept_activations_match_what_the_allocator_holds(mode, precision):
    """What each checkpointing mode keeps from the forward to the backward, per token, equals
    the bytes still allocated after the forward (two lengths, so the constant part cancels):
    float32; bf16 autocast over float32 weights (the replicated GPU run); and bf16 weights
    with no autocast (what FSDP's mixed precision computes with: a bf16 residual stream)."""
    cfg = model_preset("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    torch.manual_seed(0)
    model = Transformer(cfg, activation_checkpointing=mode)
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    autocast = precision == "bf16-autocast"
    seq = 256
    measured = (_live_after_forward_bytes(model, 2 * seq, autocast=autocast)
                - _live_after_forward_bytes(model, seq, autocast=autocast)) / seq
    assert measured == kept_activation_bytes_per_token(
        cfg, bf16=precision != "fp32", checkpointing=mode,
        bf16_weights=precision == "bf16-weights")


def test_1b_job_fits_one_h100_node():
    """jobs/llama-1b-128k-h100.yaml on 1x8xH100 (FSDP, selective checkpointing): 8 sequences x
    16384 tokens per GPU. With FSDP's bf16 weights the residual stream is bf16 and each
    norm's bf16 output feeds its projections (a*d = 4096): before the ring 16388 + 4096 =
    20484, the ring's 10368 + on a ring of 8 the last K/V block received (2*2*8*64 = 2048)
    = 12416, after it 16388 + 4096 + 65536 = 86020 B/token. Kept: 16 x (2d + 12416) = 264192,
    + the head's 21012; recomputed: 86020 -> 371224 B/token x 131072 tokens = 45.32 GiB.
    Overlap on NVLink (450 GB/s one way): F/B = 989e12 / 450e9 = 2197.8;
    backward 2197.8 * 8 * 6 / (5 * 0.5 * 32) = 1318.7 -> 1319 tokens, far below the
    16384-token block. Beside PyTorch's 47.16 GiB peak, NCCL's buffers: the zigzag ring's 7
    peers both ways x 32 channels x (10 + 2) MiB = 2.62 GiB and the FSDP communicator's 32
    channels x 12 MiB = 0.38 GiB (tests/test_plan_comm_memory.py): 50.2 GiB."""
    report = _plan(load_job_spec(JOB_1B), parse_cluster("1x8xH100"))
    cfg, inputs = report.inputs.model, report.inputs
    assert (inputs.fsdp, inputs.activation_checkpointing, inputs.shards()) == (
        True, "selective", 8)
    assert layer_activation_bytes_per_token(cfg, bf16=True) == 129160  # replicated, autocast
    assert layer_activation_bytes_per_token(cfg, bf16=True, bf16_weights=True) == 116872
    assert head_activation_bytes_per_token(cfg, bf16=True) == 21012
    assert report.memory.activations_bytes == 371224 * 131072
    assert report.memory.activations_bytes / GIB == pytest.approx(45.32, abs=0.005)
    assert report.memory.weights_bytes == 4 * math.ceil(cfg.num_params() / 8)
    assert report.overlap.link == "NVLink"
    assert report.overlap.threshold_tokens == 1319
    assert math.ceil(report.overlap.forward_threshold_tokens) == 1099
    assert report.overlap.block_tokens == 16384 and report.overlap.hidden
    assert report.memory.peak_bytes / GIB == pytest.approx(47.16, abs=0.005)
    assert report.memory.comm.total_bytes == (7 + 1) * 32 * 12 * 2**20
    assert report.fits and report.verdict.startswith("fits: 50.2 GiB of 72.0 GiB")
    # cp 4 would hold twice the activations (83 GiB) and does not fit: 8 is the smallest.
    assert not memory_breakdown(report.inputs, parse_cluster("1x8xH100"), cp=4).fits
    assert report.recommended_cp == 8 and report.recommended_layout == "zigzag"
    # The job as it was (replicated, full checkpointing): 47.5 GiB, and the ring's 2.6 GiB
    # of NCCL buffers (no FSDP communicator).
    replicated = plan(replace(inputs, fsdp=False, activation_checkpointing="full"),
                      parse_cluster("1x8xH100"))
    assert replicated.memory.peak_bytes / GIB == pytest.approx(47.5, abs=0.05)
    assert replicated.verdict.startswith("fits: 50.1 GiB of 72.0 GiB")


def test_8b_job_fits_with_fsdp_and_selective_checkpointing():
    """jobs/llama-8b-1m-64xh100.yaml on 8x8xH100: the ring of 32 spans 4 nodes, so its step
    waits on InfiniBand (50 GB/s): F/B = 19780, backward threshold 19780 * 0.6 = 11868 tokens
    < the 32768-token block (hidden). Replicated, fp32 weights (4 B), their bf16 copies (2 B
    per matmul parameter), gradients (4 B) and AdamW (8 B) would need 117 GiB per GPU
    whatever cp is. FSDP over the 64 GPUs makes that 16 B x 6.98B / 64 = 1.63 GiB; selective
    checkpointing keeps 32 x (2d + 20608 + 4096) + 42004 = 1094676 B/token (the ring's part
    with the last K/V block received, 2*2*8*128 = 4096) and recomputes 155652: 1250328
    B/token x 32768 tokens = 38.16 GiB, whose recomputed region (4.75 GiB) is rebuilt
    apart from the ring's 1.50 GiB of buffers; the gathered bf16 weights and gradients of
    the root and about two blocks 1.63 GiB -> 41.0 GiB of 72.0. NCCL's buffers, over 4 nodes
    (2 channels a peer, 16 collective and P2P channels): the ring's 7 peers on the node x 2
    x (10 + 2) MiB + the network's two shared pools of 16 x 16 x 128 KiB = 232 MiB, the FSDP
    communicator 16 x 12 MiB = 192 MiB: 41.4 GiB in all."""
    report = _plan(load_job_spec(JOB_8B), parse_cluster("8x8xH100"))
    inputs, cfg = report.inputs, report.inputs.model
    assert (inputs.fsdp, inputs.activation_checkpointing, inputs.shards()) == (
        True, "selective", 64)
    assert report.overlap.link == "InfiniBand"
    assert report.overlap.threshold_tokens == 11868 and report.overlap.hidden
    local = math.ceil(cfg.num_params() / 64)
    assert report.memory.static_bytes == 16 * local
    assert report.memory.static_bytes / GIB == pytest.approx(1.63, abs=0.005)
    assert report.memory.activations_bytes == 32768 * 1250328
    assert report.memory.activations_bytes == 32768 * activation_bytes_per_token(
        cfg, bf16=True, checkpointing="selective", bf16_weights=True, ring=32)
    assert report.memory.peak_bytes / GIB == pytest.approx(41.0, abs=0.05)
    assert (report.memory.comm.ring_bytes, report.memory.comm.fsdp_bytes) == (
        232 * 2**20, 192 * 2**20)
    assert report.fits and report.verdict == "fits: 41.4 GiB of 72.0 GiB usable per device"
    assert report.recommended_cp == 32

    replicated = plan(replace(inputs, fsdp=False, activation_checkpointing="full"),
                      parse_cluster("8x8xH100"))
    assert replicated.memory.static_bytes / GIB == pytest.approx(117.0, abs=0.05)
    assert replicated.memory.static_bytes >= 16 * cfg.num_params()
    assert not replicated.fits and replicated.recommended_cp is None
    assert "45.0 GiB over" in replicated.verdict and "so no cp helps" in replicated.verdict
    assert replicated.verdict.endswith("; lower peaks: parallel.fsdp: true 19.3 GiB")
    unsharded = plan(replace(inputs, fsdp=False), parse_cluster("8x8xH100"))  # selective
    assert unsharded.verdict.endswith(
        "; lower peaks: parallel.fsdp: true 41.4 GiB, + full checkpointing 19.3 GiB")


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
    assert data["memory"]["activations_bytes"] == 371224 * 131072
    assert data["job"]["fsdp"] is True and data["memory"]["gathered_bytes"] > 0


def test_plan_text_and_exit_code_one_when_it_does_not_fit():
    """8b at 1M tokens with cp=1 on one H100: activations alone are terabytes."""
    result = CliRunner().invoke(app, [
        "plan", JOB_8B, "--cluster", "1x1xH100",
        "--set", "parallel.cp=1", "--set", "parallel.dp=1", "--set", "train.global_batch=1",
    ])
    assert result.exit_code == 1, result.output
    assert "verdict: does not fit" in result.stdout and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["plan", JOB_8B, "--cluster", "8x8xH100",
                                      "--set", "parallel.fsdp=false"])
    assert result.exit_code == 1 and "recommended: no cp fits" in result.stdout
    result = CliRunner().invoke(app, ["plan", JOB_8B, "--cluster", "8x8xH100"])
    assert result.exit_code == 0 and "verdict: fits: 41.4 GiB" in result.stdout
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
     "--gpu-tflops: 0 is out of range; give a number from 0.01 to 1e+06"),
    # inf overflowed into a traceback; 1e-30 printed "0.0 GiB over the 0.0 GiB usable"
    (["--gpu-tflops", "300", "--link-gbps", "100", "--gpu-mem-gib", "inf"],
     "--gpu-mem-gib: inf is out of range; give a number from 1 to 1e+06 (e.g. 80"),
    (["--gpu-tflops", "300", "--link-gbps", "100", "--gpu-mem-gib", "1e-30"],
     "--gpu-mem-gib: 1e-30 is out of range"),
    (["--gpu-tflops", "nan", "--link-gbps", "100", "--gpu-mem-gib", "80"],
     "--gpu-tflops: nan is out of range"),
    (["--gpu-tflops", "300", "--link-gbps", "1e400", "--gpu-mem-gib", "80"],
     "--link-gbps: inf is out of range"),
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


# ------------------------------------------------------------------ Ulysses x ring


def test_ulysses_hand_computed_traffic_exposure_and_recommendation():
    """The hand-computed case (h=8/k=2 heads, e=32, 4 layers, seq 8192 over cp 4, 2 sequences,
    bf16 a=2, 100 TFLOP/s, 12.5 GB/s on one custom link): 4096 local tokens per rank.

    All-to-all bytes per layer, one rank, (U-1)/U x 4096 x (2h + 2kr) e a per direction:
      U=2 (r=1): 1/2 x 4096 x 20 x 32 x 2 = 2_621_440;  U=4 (r=2): 3/4 x 4096 x 24 x 64
      = 4_718_592.
    The ring, per step and layer (c_R = 8192 / R, h/U and kr/U heads, share 1/2):
      U=1 (R=4, c_R=2048): compute fwd 2 x 0.5 x 4 x 2048^2 x 32 x 8 / 1e14 = 42.95 us, bwd
        107.37 us; transfer fwd 2 x 2 x 2048 x 2 x 32 x 2 / 12.5e9 = 83.89 us, bwd (a+4)
        251.66 us -> exposed 3 steps x (40.94 + 144.29) = 555.67 us per layer.
      U=2 (R=2, c_R=4096): compute fwd 85.90 us, bwd 214.75 us; transfer fwd 83.89 us,
        bwd 251.66 us -> exposed 1 step x (0 + 36.91) = 36.91 us per layer.
      U=4 (R=1): no ring.
    Per step (4 layers): U=1 exposed 2.2227 ms; U=2 147.6 us + a2a 4 x 2 x 2_621_440 /
      12.5e9 = 1.6777 ms -> 1.8253 ms; U=4 a2a 4 x 2 x 4_718_592 / 12.5e9 = 3.0199 ms.
    U=4 is allowed (a custom device has no node size) but worse than the plain ring, so the
    recommendation is 2."""
    cfg = small_inputs().model
    assert a2a_bytes_per_layer(cfg, local_tokens=4096, ulysses=1, bf16=True) == (0, 0)
    assert a2a_bytes_per_layer(cfg, local_tokens=4096, ulysses=2, bf16=True) == (
        2_621_440, 2_621_440)
    assert a2a_bytes_per_layer(cfg, local_tokens=4096, ulysses=4, bf16=True) == (
        4_718_592, 4_718_592)

    cluster = custom_cluster(tflops=100, link_gbps=100, memory_gib=16)
    options = {o.ulysses: o for o in ulysses_options(small_inputs(), cluster)}
    assert sorted(options) == [1, 2, 4]
    assert options[1].ring_exposed_seconds == pytest.approx(4 * 555.67e-6, rel=1e-4)
    assert options[1].a2a_seconds == 0 and options[1].ring_size == 4
    assert options[2].ring_exposed_seconds == pytest.approx(4 * 36.91e-6, rel=1e-3)
    assert options[2].a2a_seconds == pytest.approx(1.6777e-3, rel=1e-4)
    assert options[2].exposed_seconds == pytest.approx(1.8253e-3, rel=1e-3)
    assert options[4].ring_size == 1 and options[4].ring_exposed_seconds == 0
    assert options[4].a2a_seconds == pytest.approx(3.0199e-3, rel=1e-4)
    assert all(o.refused is None for o in options.values())
    assert recommend_ulysses(tuple(options.values())) == 2

    check = overlap_check(small_inputs(ulysses=2), cluster)
    assert (check.ring_size, check.block_tokens, check.threshold_tokens) == (2, 4096, 4800)
    assert not check.hidden  # the backward's 251.66 us transfer > its 214.75 us compute
    report = plan(small_inputs(ulysses=2), cluster)
    assert report.recommended_ulysses == 2 and report.job_ulysses.ulysses == 2
    text = report.format()
    assert "mesh: dp 1 x cp 4 = ring 2 x ulysses 2 (zigzag)" in text
    assert "recommended at cp 4: ulysses 2 (ring 2 x ulysses 2)" in text


def test_ulysses_memory_terms():
    """Per token with Ulysses (a=2, h=8, k=2, e=32): ring attention's saved tensors are
    1312 at U=1; U=2 adds the output's all-to-all copy (ahe = 512): 1824; U=4 repeats K/V x2
    (2akre = 512 instead of 256) with the copy: 2080. Ring buffers at cp 4, U=2 (ring of 2,
    K/V block 2kre = 128 elements): forward one incoming block 256 + 1024 + the caller's
    q/k/v 768 = 2048; backward three fp32 dK/dV sums 1536 (nothing received on a ring of 2)
    + dQ 1024 + dq/dk/dv cast back (256 + 128) x 2 = 768 + dout in heads 512 = 3840 > the
    dq/dk/dv all-to-all's 4 x 12 x 32 x 2 = 3072."""
    cfg = small_inputs().model
    plain = layer_activation_bytes_per_token(cfg, bf16=True)
    assert layer_activation_bytes_per_token(cfg, bf16=True, ulysses=2) == plain + 512
    assert layer_activation_bytes_per_token(cfg, bf16=True, ulysses=4) == plain + 768
    assert ring_buffer_bytes_per_token(cfg, cp=4, bf16=True, ulysses=2) == 3840
    # A ring of one (cp 4 = ulysses 4): no incoming block or spares; the all-to-all's four
    # copies of (8 + 2 x 2 x 2) heads x 32 x 2 = 4096 are the larger.
    assert ring_buffer_bytes_per_token(cfg, cp=4, bf16=True, ulysses=4) == 4096
    with_ulysses = memory_breakdown(small_inputs(ulysses=2), parse_cluster("1x8xH100"))
    assert with_ulysses.ring_buffers_bytes == 4096 * 3840


def test_ulysses_groups_larger_than_a_node_or_heads_that_do_not_split_are_refused():
    """On 2 nodes x 2 H100s a group of 4 cannot sit on one node; a model with 3 kv heads
    cannot share them over 2 or 4 ranks. The job's own refused degree makes it not fit."""
    options = {o.ulysses: o for o in ulysses_options(small_inputs(), parse_cluster("2x2xH100"))}
    assert options[4].refused == "a group of 4 does not fit a node of 2"
    assert options[2].refused is None
    report = plan(small_inputs(ulysses=4), parse_cluster("2x2xH100"))
    assert not report.fits
    assert ("parallel.ulysses: 4 is not allowed here: a group of 4 does not fit a node of 2"
            in report.verdict)
    odd = small_inputs(model=model_preset("debug", dim=384, n_layers=2, n_heads=12,
                                          n_kv_heads=3, ffn_hidden=512))
    options = {o.ulysses: o for o in ulysses_options(odd, parse_cluster("1x8xH100"))}
    assert options[2].refused == "heads 12/3 do not split over 2"
    assert options[2].exposed_seconds is None
    assert recommend_ulysses(tuple(options.values())) == 1


def test_hidden_ring_needs_no_ulysses():
    """The 8B job's ring of 32 hides its transfers on InfiniBand (see above), so every
    U > 1 only adds all-to-all time: the recommendation is 1, and groups of 16 and 32 do not
    fit an 8-GPU node."""
    report = _plan(load_job_spec(JOB_8B), parse_cluster("8x8xH100"))
    options = {o.ulysses: o for o in report.ulysses_options}
    assert sorted(options) == [1, 2, 4, 8, 16, 32]
    assert options[1].ring_hidden and options[1].exposed_seconds == 0
    assert all(options[u].a2a_seconds > 0 for u in (2, 4, 8))
    assert options[16].refused == "a group of 16 does not fit a node of 8"
    assert report.recommended_ulysses == 1


def test_plan_command_shows_ulysses_beside_the_ring():
    """`ringray plan --set parallel.ulysses=2`: the mesh line, the a2a table with this job's
    row, and the JSON's per-degree figures."""
    args = ["plan", JOB_1B, "--cluster", "2x8xH100", "--set", "parallel.cp=16",
            "--set", "parallel.ulysses=2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "= ring 8 x ulysses 2 (zigzag)" in result.stdout
    assert "all-to-alls on NVLink (450 GB/s one way)" in result.stdout
    assert "<- this job" in result.stdout and "recommended at cp 16: ulysses" in result.stdout
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert data["job"]["ulysses"] == 2 and data["overlap"]["ring_size"] == 8
    assert [row["ulysses"] for row in data["ulysses"]] == [1, 2, 4, 8, 16]
    assert data["ulysses"][1]["a2a_seconds"] > 0
    bad = CliRunner().invoke(app, ["plan", JOB_1B, "--cluster", "1x8xH100",
                                   "--set", "parallel.ulysses=3"])
    assert bad.exit_code == 2 and "parallel.ulysses: 3 does not divide cp=8" in bad.output


# ------------------------------------------------------------------ before `ringray train`


def test_a_worker_is_refused_when_its_planned_peak_exceeds_its_share_of_the_node():
    """The quickstart at seq 16M on CPU (issue 28: workers grew to 9 GB each until Ray killed
    them): the planned peak, float32 on a CPU, is the plan's own figure, and the share is the
    node's memory over the workers on it, less the reserve."""
    from ringray.capacity import WorkerShare, check_worker_memory, plan_footprint, runs_bf16

    options = load_job_spec("jobs/quickstart.yaml", ["train.seq_len=16777216"],
                            check_paths=False).train_options()
    share = WorkerShare(node="this host's available memory", node_bytes=64 * GIB, workers=4)
    refusal = check_worker_memory(options, dp=1, cp=4, on_gpu=False, share=share)
    inputs = PlanInputs.of_mesh(options, dp=1, cp=4, name="q", bf16=False, foreach=False)
    peak = plan_footprint(inputs).peak_bytes
    assert refusal is not None and peak > 100 * GIB
    assert f"one worker needs about {peak / GIB:.1f} GiB" in refusal
    assert "more than the 14.4 GiB it has (this host's available memory, 64.0 GiB shared by " \
           "4 workers, less 10% reserve)" in refusal
    assert "--force" in refusal and "\n" not in refusal

    small = load_job_spec("jobs/quickstart.yaml", [], check_paths=False).train_options()
    assert check_worker_memory(small, dp=1, cp=4, on_gpu=False, share=share) is None
    # A GPU worker owns its device; auto precision is bf16 there, float32 on a CPU.
    device = WorkerShare(node="GPU", node_bytes=80 * GIB)
    assert device.usable_bytes == int(80 * GIB * 0.9)
    assert runs_bf16("auto", on_gpu=True) and not runs_bf16("auto", on_gpu=False)
    assert runs_bf16("bf16", on_gpu=False) and not runs_bf16("fp32", on_gpu=True)


def test_the_steps_temporaries_follow_the_device_and_the_group() -> None:
    """AdamW's update is foreach on CUDA (a temporary of every local parameter) and one
    tensor at a time on CPU (about two of the largest parameter: measured 262 MiB beside a
    125 MiB embedding, benchmarks/replica_memory.py); a replicated group of more than one
    rank adds its flat all-reduce buffer; replica groups' bucketed average adds nothing."""
    from ringray.train.footprint import largest_param, step_transient_bytes

    cfg = model_preset("small", dim=1024, n_layers=16, n_heads=16, n_kv_heads=8,
                       ffn_hidden=2816, vocab_size=32000)
    params = cfg.num_params()
    assert largest_param(cfg) == 32000 * 1024
    assert step_transient_bytes(cfg, shards=1, ranks=1, foreach=True) == 4 * params
    assert step_transient_bytes(cfg, shards=1, ranks=1, foreach=False) == 8 * 32000 * 1024
    assert step_transient_bytes(cfg, shards=1, ranks=2, foreach=False) == 4 * params
    assert step_transient_bytes(cfg, shards=4, ranks=4, foreach=False) == 8 * 32000 * 1024 // 4
