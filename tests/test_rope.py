"""RoPE scaling against transformers' own frequency functions, and the job spec's overrides.

- ``rope_inv_freq`` and ``rope_attention_factor`` equal ``transformers.modeling_rope_utils
  .ROPE_INIT_FUNCTIONS`` for linear, llama3 (Llama 3.1's published parameters) and yarn
  (defaults, explicit betas, ``truncate=False``, an explicit attention factor, DeepSeek's
  ``mscale``/``mscale_all_dim``), at realistic head sizes; ours are float64, HF's float32.
- The yarn attention factor multiplies cos and sin.
- ``ModelOptions.rope`` overrides keep, change or replace the model's scaling, and name the
  field of a bad combination.
"""

from __future__ import annotations

import math

import pytest
import torch

from ringray.model import (
    ModelOptions,
    RopeOptions,
    RopeScaling,
    rope_attention_factor,
    rope_inv_freq,
    rotary_tables,
)

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

HF_CASES = {
    "linear": (128, 10_000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3.1": (128, 500_000.0, LLAMA31),
    "llama3 small head": (16, 500_000.0, {**LLAMA31, "original_max_position_embeddings": 16}),
    "yarn": (128, 1_000_000.0, {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}),
    "yarn betas, no truncate": (64, 10_000.0, {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
    "yarn attention factor": (64, 10_000.0, {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
        "attention_factor": 1.25}),
    "yarn mscale": (128, 10_000.0, {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 0.707}),
}


def hf_rope(head_dim: int, theta: float, params: dict) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=params.get("original_max_position_embeddings",
                                                            4096) * int(params["factor"]),
                         rope_parameters={**params, "rope_theta": theta})
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")


def ours(params: dict) -> RopeScaling:
    kind = params["rope_type"]
    return RopeScaling(kind=kind, **{k: v for k, v in params.items() if k != "rope_type"})


@pytest.mark.parametrize("case", list(HF_CASES))
def test_inv_freq_and_attention_factor_match_transformers(case: str) -> None:
    """Frequencies equal HF's to float32 precision (rtol 1e-6); the cos/sin multiplier equals
    HF's ``attention_factor`` to 1e-12."""
    head_dim, theta, params = HF_CASES[case]
    hf_inv_freq, hf_factor = hf_rope(head_dim, theta, params)
    scaling = ours(params)
    got = rope_inv_freq(head_dim, theta, scaling)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(hf_factor, rel=1e-12)
    plain = rope_inv_freq(head_dim, theta, RopeScaling())
    assert not torch.allclose(got, plain)  # the scaling does something here


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    """cos and sin carry yarn's factor (``0.1 ln 4 + 1`` for factor 4): cos^2 + sin^2 is its
    square at every position."""
    scaling = RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=64)
    cos, sin = rotary_tables(torch.arange(300), 32, 10_000.0, torch.float64, scaling=scaling)
    want = (0.1 * math.log(4.0) + 1.0) ** 2
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, want), atol=1e-12, rtol=0)


def test_linear_scaling_is_position_interpolation() -> None:
    """Linear scaling by f at position p gives the unscaled tables at p / f."""
    scaling = RopeScaling(kind="linear", factor=4.0)
    positions = torch.arange(0, 4000, 4)
    cos, sin = rotary_tables(positions, 64, 10_000.0, torch.float64, scaling=scaling)
    cos_ref, sin_ref = rotary_tables(positions // 4, 64, 10_000.0, torch.float64)
    torch.testing.assert_close(cos, cos_ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(sin, sin_ref, atol=1e-9, rtol=0)


def test_rope_overrides_keep_change_or_replace_the_scaling() -> None:
    """Unset fields keep the model's; a new kind starts from its defaults but keeps the
    pretraining length; ``none`` drops the scaling."""
    llama31 = RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=8192)
    theta, same = RopeOptions().apply(500_000.0, llama31)
    assert (theta, same) == (500_000.0, llama31)
    _, factor = RopeOptions(factor=16.0, theta=None).apply(500_000.0, llama31)
    assert factor == RopeScaling(kind="llama3", factor=16.0, original_max_position_embeddings=8192)
    theta, yarn = RopeOptions(scaling="yarn", factor=4.0, theta=1e6).apply(500_000.0, llama31)
    assert theta == 1e6
    assert yarn == RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=8192)
    assert RopeOptions(scaling="none").apply(500_000.0, llama31)[1] == RopeScaling()


@pytest.mark.parametrize(
    ("rope", "pattern"),
    [
        (RopeOptions(factor=2.0), r"^rope\.factor: has no effect without a scaling kind"),
        # a new kind without a factor meant x1 (issue 40): refused, for each kind
        (RopeOptions(scaling="linear"), r"^rope\.factor: not set; rope\.scaling: linear "
                                        r"\(the model's is none\) needs the context"),
        (RopeOptions(scaling="yarn", original_max_position_embeddings=512),
         r"^rope\.factor: not set; rope\.scaling: yarn"),
        (RopeOptions(scaling="llama3", original_max_position_embeddings=512),
         r"^rope\.factor: not set; rope\.scaling: llama3"),
        (RopeOptions(scaling="yarn", factor=2.0),
         r"^rope\.original_max_position_embeddings: not set; scaling 'yarn' needs"),
        (RopeOptions(scaling="llama3", factor=8.0, original_max_position_embeddings=8192,
                     low_freq_factor=4.0, high_freq_factor=1.0),
         r"^rope\.high_freq_factor: llama3 scaling needs 0 < low_freq_factor < high_freq"),
    ],
)
def test_bad_rope_overrides_name_the_field(rope: RopeOptions, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ModelOptions(rope=rope).build()


def test_job_spec_rope_section_reaches_the_model_config() -> None:
    """The spec's ``model.rope`` section is ModelOptions' (no spec code for it)."""
    from ringray.spec import parse_job_spec

    spec = {"model": {"preset": "debug", "rope": {"scaling": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 512,
                                                  "theta": 1e6}}}
    model = parse_job_spec(spec).train_options().model
    assert model.rope_theta == 1e6
    assert model.rope_scaling == RopeScaling(kind="yarn", factor=4.0,
                                             original_max_position_embeddings=512)
    with pytest.raises(ValueError, match=r"model\.rope_theta: .* give one of them"):
        parse_job_spec({"model": {"rope_theta": 1.0, "rope": {"theta": 2.0}}})
