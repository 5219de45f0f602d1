"""The Llama-style decoder against references nobody here wrote, and its config's arithmetic.

- HF transformers' ``LlamaForCausalLM`` with our weights copied in gives the same logits and
  the same gradients (float32 and float64).
- Rotary embeddings: scores depend only on the position difference (checked against the
  closed form in float64 complex arithmetic) and are built from *global* positions.
- Presets: ``num_params`` equals the instantiated module's count; ``flops_per_token`` equals
  hand arithmetic; the debug preset learns.
- Feature fields (biases, q/k norms, explicit head_dim, tied embeddings, RoPE scaling):
  ``num_params`` still counts the module; ``to_dict`` of a model without them is the dict
  checkpoints recorded before they existed.
- ``ModelConfig`` errors name the field; activation checkpointing changes nothing numerically;
  ``model(tokens)`` without a ring is the one-rank call.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ringray.attention import make_layout
from ringray.model import (
    ModelConfig,
    RingContext,
    RopeScaling,
    Transformer,
    apply_rotary,
    model_preset,
    rotary_tables,
)
from ringray.model.llama import Block, RMSNorm

SEQ = 32
F32_TOL = {"atol": 1e-5, "rtol": 1e-5}

# ---------------------------------------------------------------------------------------------
# HF transformers' Llama as the reference
# ---------------------------------------------------------------------------------------------

# Our module path inside a block -> HF's.
_HF_BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """HF parameter name of our parameter ``name`` (e.g. ``layers.0.attention.wq.weight``)."""
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    _, index, *module, leaf = name.split(".")
    return f"model.layers.{index}.{_HF_BLOCK_NAMES['.'.join(module)]}.{leaf}"


def debug_model(seed: int = 0) -> Transformer:
    """The debug preset with random (not all-ones) norm weights, so a norm mapped to the wrong
    place, or not at all, changes the output."""
    torch.manual_seed(seed)
    model = Transformer(model_preset("debug"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def hf_llama_like(model: Transformer) -> torch.nn.Module:
    """An HF ``LlamaForCausalLM`` of the same shape holding a copy of ``model``'s weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=4 * SEQ,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",  # exact in the input dtype (eager's softmax is float32)
    )
    hf = LlamaForCausalLM(hf_cfg)
    state = {hf_name(n): p.detach().clone() for n, p in model.named_parameters()}
    hf.load_state_dict(state, strict=True)  # strict: every HF weight is one of ours
    return hf


def loss_and_grads(
    logits: torch.Tensor, targets: torch.Tensor, params: dict[str, torch.nn.Parameter]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(params, grads, strict=True))


# Weights whose gradients are compared: the two ends of the network, a norm, each projection
# kind in both layers between them.
GRAD_PARAMS = (
    "tok_embeddings.weight",
    "layers.0.attention.wq.weight",
    "layers.0.attention.wk.weight",
    "layers.0.attention_norm.weight",
    "layers.1.attention.wv.weight",
    "layers.1.feed_forward.w2.weight",
    "norm.weight",
    "output.weight",
)


def compare_with_hf(dtype: torch.dtype, backend: str, tol: dict[str, float]) -> None:
    ours = debug_model().to(dtype)
    hf = hf_llama_like(ours).to(dtype)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ours.config.vocab_size, (2, SEQ + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    ring = RingContext(layout=make_layout("contiguous", 1, SEQ), backend=backend)
    our_logits = ours(inputs, ring)
    hf_logits = hf(input_ids=inputs).logits
    assert our_logits.dtype == hf_logits.dtype == dtype
    torch.testing.assert_close(our_logits, hf_logits, **tol)

    hf_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    our_loss, our_grads = loss_and_grads(
        our_logits, targets, {n: our_params[n] for n in GRAD_PARAMS}
    )
    hf_loss, hf_grads = loss_and_grads(
        hf_logits, targets, {n: hf_params[hf_name(n)] for n in GRAD_PARAMS}
    )
    torch.testing.assert_close(our_loss, hf_loss, **tol)
    for name in GRAD_PARAMS:
        scale = hf_grads[name].abs().max().item()
        torch.testing.assert_close(
            our_grads[name], hf_grads[name], atol=tol["atol"] * scale, rtol=tol["rtol"],
            msg=lambda m, n=name: f"grad of {n}: {m}",
        )


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_matches_hf_llama_float32(backend: str) -> None:
    """Logits, loss and gradients equal HF ``LlamaForCausalLM``'s with the same weights
    (float32, atol = rtol = 1e-5; gradient atol relative to the tensor's largest entry).

    This pins the whole block: pre-norm RMSNorm with eps, half-split rotary at theta, GQA
    head grouping, SwiGLU order (gate = w1, up = w3), causal masking, the 1/sqrt(head_dim)
    scale, and the final norm and output head."""
    compare_with_hf(torch.float32, backend, F32_TOL)


def test_matches_hf_llama_float64() -> None:
    """The same comparison with both models in float64.

    The tolerance is float32's, not float64's: both implementations form RMSNorm and the
    rotary tables in float32 even for float64 inputs (HF's ``LlamaRMSNorm`` casts to float32;
    its rotary frequencies are float32; ours stay in float64, see
    ``test_norm_and_rotary_are_float64_exact``). With HF's casts removed too, the logits
    agree to ~1e-15. The float64 run removes accumulation-order noise from the
    matmuls, so what remains is the rounding of those few casts (~1e-7 here)."""
    compare_with_hf(torch.float64, "reference", {"atol": 1e-6, "rtol": 1e-6})


def test_norm_and_rotary_are_float64_exact() -> None:
    """For float64 inputs, RMSNorm and rotary agree with the float64 equations to 1e-12:
    ``x / sqrt(mean(x^2) + eps) * w`` and ``(x1 + i x2) * exp(i p theta^(-2m/d))``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, generator=g)
    norm = RMSNorm(16, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    want_norm = x * (x.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * norm.weight
    torch.testing.assert_close(norm(x).detach(), want_norm.detach(), atol=1e-12, rtol=1e-12)

    positions = torch.tensor([0, 7, 1000, 65_000, 500_000])
    cos, sin = rotary_tables(positions, 16, 10_000.0, torch.float64)
    got = apply_rotary(x, cos, sin)
    torch.testing.assert_close(got, rotary_closed_form(x, positions, 10_000.0),
                               atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Rotary embeddings
# ---------------------------------------------------------------------------------------------


def rotary_closed_form(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE in float64 complex arithmetic, half-split pairing: element m pairs with m + d/2
    as ``x_m + i x_{m+d/2}``, rotated by ``p * theta^(-2m/d)`` (RoFormer, eq. 34)."""
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angles = positions.double()[:, None] * inv_freq[None, :]
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.cat((rotated.real, rotated.imag), dim=-1)


def rotated_score(q: torch.Tensor, k: torch.Tensor, i: int, j: int, theta: float) -> torch.Tensor:
    """``<R_i q, R_j k>`` per head through our tables; q, k are ``(heads, head_dim)``."""
    cos, sin = rotary_tables(torch.tensor([i, j]), q.shape[-1], theta)
    q_rot = apply_rotary(q[None, None], cos[:1], sin[:1])
    k_rot = apply_rotary(k[None, None], cos[1:], sin[1:])
    return (q_rot * k_rot).sum(-1).flatten().double()


@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
def test_rotary_score_depends_only_on_relative_position(theta: float) -> None:
    """``<R_i q, R_j k>`` is the same for (i, j) and (i + s, j + s), for shifts up to 10^6,
    and equals the closed form ``Re sum_m q_m conj(k_m) exp(i (i - j) theta^(-2m/d))``
    (float32 tables: atol 1e-5 on unit-scale scores)."""
    g = torch.Generator().manual_seed(0)
    head_dim = 32
    q = torch.randn(4, head_dim, generator=g) / math.sqrt(head_dim)
    k = torch.randn(4, head_dim, generator=g)
    half = head_dim // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / head_dim)
    q_c = torch.complex(q[:, :half].double(), q[:, half:].double())
    k_c = torch.complex(k[:, :half].double(), k[:, half:].double())
    for i, j in [(5, 2), (2, 5), (100, 0), (7, 7), (4000, 3999)]:
        phase = torch.polar(torch.ones(half, dtype=torch.float64), (i - j) * inv_freq)
        want = (q_c * k_c.conj() * phase).sum(-1).real
        for shift in (0, 1, 17, 1000, 65_536, 1_000_000):
            got = rotated_score(q, k, i + shift, j + shift, theta)
            torch.testing.assert_close(
                got, want, atol=1e-5, rtol=1e-5, msg=lambda m, a=(i, j, shift): f"{a}: {m}"
            )


def test_rotary_matches_closed_form() -> None:
    """``apply_rotary(x, *rotary_tables(p))`` equals RoPE written in complex arithmetic."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 16, generator=g)
    positions = torch.tensor([0, 1, 2, 31, 1000, 20_000])
    cos, sin = rotary_tables(positions, 16, 10_000.0)
    torch.testing.assert_close(
        apply_rotary(x, cos, sin).double(), rotary_closed_form(x, positions, 10_000.0),
        atol=1e-5, rtol=1e-5,
    )


@pytest.mark.parametrize("kind", ["zigzag", "striped", "contiguous"])
def test_rotary_tables_use_global_positions(kind: str) -> None:
    """A rank's tables are the rows of the full-sequence table at the global positions it
    holds (zigzag rank 0 of 2 over 16 tokens holds 0-3 and 12-15), and the model's
    RingContext hands exactly those positions to them."""
    seq, world, head_dim, theta = 16, 2, 32, 10_000.0
    layout = make_layout(kind, world, seq)
    full_cos, full_sin = rotary_tables(torch.arange(seq), head_dim, theta)
    if kind == "zigzag":
        assert layout.positions(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    for rank in range(world):
        ring = RingContext(layout=layout, rank=rank)
        positions = ring.positions(torch.device("cpu"))
        torch.testing.assert_close(positions, layout.positions(rank))
        cos, sin = rotary_tables(positions, head_dim, theta)
        torch.testing.assert_close(cos, full_cos[positions], atol=0, rtol=0)
        torch.testing.assert_close(sin, full_sin[positions], atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_model_uses_global_positions(backend: str) -> None:
    """A one-rank layout that stores the sequence in a shuffled local order computes the same
    logits, token by token, as the in-order layout: rotary and the causal mask follow each
    token's global position, not its local index."""
    model = debug_model()
    seq = 24
    tokens = torch.randint(0, model.config.vocab_size, (2, seq),
                           generator=torch.Generator().manual_seed(2))
    order = torch.randperm(seq, generator=torch.Generator().manual_seed(3))
    shuffled = make_layout([order.tolist()], 1, seq)
    in_order = model(tokens, RingContext(layout=make_layout("contiguous", 1, seq), backend=backend))
    got = model(tokens[:, order], RingContext(layout=shuffled, backend=backend))
    torch.testing.assert_close(got, in_order[:, order], **F32_TOL)


# ---------------------------------------------------------------------------------------------
# Presets, parameter and FLOP counts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["debug", "small", "1b", "8b"])
def test_num_params_counts_the_module(preset: str) -> None:
    """``num_params()`` equals the parameter count of the instantiated model (on the meta
    device: no memory), with and without the input embedding table."""
    cfg = model_preset(preset)
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == total
    assert cfg.num_params(embeddings=False) == total - model.tok_embeddings.weight.numel()


def test_large_presets_are_llama_sized() -> None:
    """The 1b and 8b presets hold Llama 3.2 1B / Llama 3 8B block shapes: with a 128k vocab
    and tied (1B) or untied (8B) embeddings they are the published 1.24B and 8.03B."""
    llama_vocab = 128_256
    b1 = model_preset("1b", vocab_size=llama_vocab, tie_embeddings=True)
    assert round(b1.num_params() / 1e9, 2) == 1.24
    assert round(model_preset("8b", vocab_size=llama_vocab).num_params() / 1e9, 2) == 8.03


FEATURES = {
    "tied": dict(tie_embeddings=True),
    "qkv bias": dict(qkv_bias=True),
    "all biases": dict(qkv_bias=True, o_bias=True, mlp_bias=True),
    "qk norm, head_dim": dict(qk_norm=True, explicit_head_dim=48, dim=96, n_heads=4),
    "yarn": dict(rope_scaling=RopeScaling(kind="yarn", factor=4.0,
                                          original_max_position_embeddings=64)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_num_params_counts_the_module_with_features(feature: str) -> None:
    """With each feature ``num_params()`` is the module's (unique) parameter count; without
    the input table it leaves out the embedding, except that a tied table is also the output
    head, which every token is multiplied by, so it stays."""
    cfg = model_preset("debug", **FEATURES[feature])
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == total
    table = 0 if cfg.tie_embeddings else model.tok_embeddings.weight.numel()
    assert cfg.num_params(embeddings=False) == total - table
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    if cfg.explicit_head_dim:
        assert model.layers[0].attention.wq.weight.shape == (4 * 48, 96)


def test_to_dict_of_a_preset_is_unchanged_and_features_round_trip() -> None:
    """Checkpoints compare ``to_dict()``: a model without the feature fields has exactly the
    keys recorded before they existed; with them, ``from_dict`` gives the config back."""
    assert sorted(model_preset("debug").to_dict()) == sorted(
        ["vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "rope_theta",
         "norm_eps", "init_std"])
    for feature in FEATURES.values():
        cfg = model_preset("debug", **feature)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
        assert set(feature) <= set(cfg.to_dict())


def test_forward_without_a_ring_is_the_one_rank_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model(tokens)`` equals ``model(tokens, one-rank contiguous ring)``; inside a
    multi-rank job it refuses to guess the ring."""
    model = debug_model()
    tokens = torch.randint(0, model.config.vocab_size, (2, 24),
                           generator=torch.Generator().manual_seed(6))
    ring = RingContext(layout=make_layout("contiguous", 1, 24))
    torch.testing.assert_close(model(tokens), model(tokens, ring), atol=0, rtol=0)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    with pytest.raises(ValueError, match=r"^ring: torch.distributed is initialised with 4"):
        model(tokens)


def test_flops_per_token_hand_arithmetic() -> None:
    """``6 N + 3 (4 S H hd L) / 2`` for causal attention (``/ 2`` dropped for full), where
    N counts every weight a token's activations are multiplied by (so the output head, but
    not the input embedding lookup).

    dim 8, 2 layers, 2 heads (hd 4), 1 kv head, ffn 16, vocab 10, S = 32:
    per layer 8*8 + 8*4 + 8*4 + 8*8 = 192 attention, 3*8*16 = 384 MLP, 2*8 = 16 norms:
    592; N = 2*592 + 8 (final norm) + 80 (output) = 1272, with the embedding 1352.
    6 N = 7632; attention 4*32*2*4*2 = 2048 forward, times 3 = 6144, halved = 3072."""
    cfg = ModelConfig(vocab_size=10, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=16)
    assert cfg.num_params(embeddings=False) == 1272
    assert cfg.num_params() == 1352
    assert cfg.flops_per_token(32) == 7632 + 3072
    assert cfg.flops_per_token(32, causal=False) == 7632 + 6144


def test_debug_preset_learns() -> None:
    """Twenty SGD steps on one repeated small batch at least halve the debug model's loss,
    which starts near ln(vocab) (a random-init model predicts near-uniformly)."""
    torch.manual_seed(0)
    model = Transformer(model_preset("debug"))
    seq = 16
    tokens = torch.randint(0, model.config.vocab_size, (2, seq + 1),
                           generator=torch.Generator().manual_seed(4))
    ring = RingContext(layout=make_layout("contiguous", 1, seq), backend="sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for _ in range(20):
        logits = model(tokens[:, :-1], ring)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(model.config.vocab_size)) < 0.1, losses[0]
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------------------------------------
# ModelConfig validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"dim": 130, "n_heads": 4}, r"^dim: 130 is not divisible by n_heads=4"),
        ({"n_heads": 4, "n_kv_heads": 3},
         r"^n_kv_heads: n_heads=4 is not divisible by n_kv_heads=3"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 2}, r"^dim: head_dim=3 must be even"),
        ({"n_layers": 0}, r"^n_layers: must be >= 1, got 0"),
        ({"n_kv_heads": 0}, r"^n_kv_heads: must be >= 1, got 0"),
        ({"explicit_head_dim": 15}, r"^explicit_head_dim: head_dim=15 must be even"),
        ({"rope_theta": 0.0}, r"^rope_theta: must be a positive number, got 0.0"),
        ({"rope_scaling": {"kind": "yarn"}}, r"^rope_scaling: expected a RopeScaling, got dict"),
    ],
)
def test_model_config_errors_name_the_field(kwargs: dict, pattern: str) -> None:
    """Each invalid shape is rejected with a message that starts with the field to change."""
    with pytest.raises(ValueError, match=pattern):
        ModelConfig(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        model_preset("debug", **kwargs)  # presets with overrides are validated the same way


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'huge' is unknown; valid: \['1b', '70b', '8b', "
                       r"'debug', 'small'\]"):
        model_preset("huge")


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------


def test_activation_checkpointing_same_loss_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """With activation checkpointing the loss and every gradient are the same as without
    (float32, atol = rtol = 1e-6), and each block really is run a second time in backward."""
    block_calls = [0]
    block_forward = Block.forward

    def counted_forward(self: Block, *args: object) -> torch.Tensor:
        block_calls[0] += 1
        return block_forward(self, *args)

    # Module hooks do not fire in the checkpoint's recompute, so count the method itself.
    monkeypatch.setattr(Block, "forward", counted_forward)
    plain = debug_model()
    checkpointed = Transformer(plain.config, activation_checkpointing=True)
    checkpointed.load_state_dict(plain.state_dict())
    seq = 16
    tokens = torch.randint(0, plain.config.vocab_size, (2, seq + 1),
                           generator=torch.Generator().manual_seed(5))
    ring = RingContext(layout=make_layout("zigzag", 1, seq), backend="sdpa")

    results = []
    for model in (plain, checkpointed):
        block_calls[0] = 0
        loss, grads = loss_and_grads(model(tokens[:, :-1], ring), tokens[:, 1:],
                                     dict(model.named_parameters()))
        results.append((loss, grads, block_calls[0]))
    (loss, grads, calls), (ck_loss, ck_grads, ck_calls) = results
    n_layers = plain.config.n_layers
    assert (calls, ck_calls) == (n_layers, 2 * n_layers)
    torch.testing.assert_close(ck_loss, loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(ck_grads[name], grad, atol=1e-6, rtol=1e-6,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
