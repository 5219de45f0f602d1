"""Rotary position embeddings: the frequencies (plain, or scaled for longer context) and the
rotation itself.

    scaling = RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=8192)
    cos, sin = rotary_tables(positions, head_dim=128, theta=500_000.0, scaling=scaling)
    q = apply_rotary(q, cos, sin)

Scaling stretches the low frequencies so that a model trained at one context length keeps
working at a longer one. The kinds and their formulas are those of HF transformers
(``modeling_rope_utils``), so a Hugging Face checkpoint computes the same function here:

- ``linear`` (position interpolation): every frequency divided by ``factor``.
- ``llama3`` (Llama 3.1): wavelengths longer than ``original / low_freq_factor`` divided by
  ``factor``, shorter than ``original / high_freq_factor`` kept, a smooth blend between.
- ``yarn`` (YaRN): a linear ramp over dimensions between the correction range that
  ``beta_fast``/``beta_slow`` rotations give at the original length blends interpolated and
  original frequencies, and cos/sin are multiplied by an attention factor (``0.1 ln(factor)
  + 1`` unless given), which scales the attention logits by its square.

Frequencies and angles are formed in float64: at long context ``position * frequency`` loses
precision in float32, and the tables are small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

ROPE_SCALING_KINDS = ("none", "linear", "llama3", "yarn")
"""Supported kinds of RoPE scaling (HF's ``rope_type``; ``none`` is HF's ``default``)."""

RopeScalingKind = Literal[ROPE_SCALING_KINDS]


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How rotary frequencies are stretched for longer context (``kind="none"``: not at all).

    Fields a kind does not use are ignored by it (and left at their defaults when a model is
    saved, so equal models compare equal).
    """

    kind: RopeScalingKind = "none"
    factor: float = 1.0
    """Context extension factor (linear, llama3, yarn)."""
    original_max_position_embeddings: int | None = None
    """Context length the model was pretrained at (llama3, yarn; required by them)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above ``original / low_freq_factor`` are divided by ``factor``."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below ``original / high_freq_factor`` are kept."""
    beta_fast: float = 32.0
    """yarn: rotations at the original length where the ramp starts (extrapolation side)."""
    beta_slow: float = 1.0
    """yarn: rotations at the original length where the ramp ends (interpolation side)."""
    attention_factor: float | None = None
    """yarn: multiplier of cos and sin; None: from ``factor`` (and ``mscale``s, if set)."""
    mscale: float | None = None
    """yarn (DeepSeek style): numerator scale of the inferred attention factor."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek style): denominator scale of the inferred attention factor."""
    truncate: bool = True
    """yarn: round the correction range outwards to whole dimensions."""

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not a RoPE scaling kind; valid: "
                             f"{', '.join(ROPE_SCALING_KINDS)}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"factor: {self.factor} must be a positive number")
        if self.kind in ("llama3", "yarn"):
            original = self.original_max_position_embeddings
            if original is None or original < 1:
                given = "not set" if original is None else str(original)
                raise ValueError(f"original_max_position_embeddings: {given}; scaling "
                                 f"{self.kind!r} needs the pretraining context length (>= 1), "
                                 f"e.g. 8192")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"high_freq_factor: llama3 scaling needs 0 < low_freq_factor < "
                             f"high_freq_factor, got {self.low_freq_factor} and "
                             f"{self.high_freq_factor}")
        if self.kind == "yarn":
            if not 0 < self.beta_slow < self.beta_fast:
                raise ValueError(f"beta_fast: yarn scaling needs 0 < beta_slow < beta_fast, got "
                                 f"{self.beta_slow} and {self.beta_fast}")
            if self.attention_factor is not None and self.attention_factor <= 0:
                raise ValueError(f"attention_factor: {self.attention_factor} must be > 0")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies ``(head_dim // 2,)`` in float64, scaled as ``scaling`` says."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    original = s.original_max_position_embeddings
    low_freq_wavelen = original / s.low_freq_factor
    high_freq_wavelen = original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling
) -> torch.Tensor:
    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits ``rotations`` times into the original context.
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(scaling: RopeScaling) -> float:
    """The multiplier of cos and sin: 1 except for yarn (HF's ``attention_factor``)."""
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor,
                                                               scaling.mscale_all_dim)
    return mscale(scaling.factor)


def describe_rope(theta: float, scaling: RopeScaling, head_dim: int) -> str:
    """One line saying what the RoPE settings do (``ringray plan`` prints it)."""
    longest = 2 * math.pi / float(rope_inv_freq(head_dim, theta, scaling).min())
    base = f"base {theta:g}"
    s, n = scaling, scaling.original_max_position_embeddings
    if s.kind == "linear":
        what = (f"linear x{s.factor:g}: every frequency divided by {s.factor:g}, positions "
                f"compressed {s.factor:g}-fold")
    elif s.kind == "llama3":
        what = (f"llama3 x{s.factor:g} from {n} tokens: wavelengths longer than "
                f"{n / s.low_freq_factor:g} tokens stretched {s.factor:g}-fold, shorter than "
                f"{n / s.high_freq_factor:g} kept, a smooth ramp between")
    elif s.kind == "yarn":
        what = (f"yarn x{s.factor:g} from {n} tokens: dimensions turning fewer than "
                f"{s.beta_slow:g} times over {n} tokens interpolated, more than "
                f"{s.beta_fast:g} kept, a ramp between; attention scaled by "
                f"{rope_attention_factor(s):.3f}")
    else:
        what = "no scaling: positions past the pretraining length are extrapolated"
    return f"{base}, {what}; longest wavelength {longest:,.0f} tokens"


def rotary_tables(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype = torch.float32,
    *,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``(local_seq, head_dim)``, for the given global positions.

    Angles are formed in float64 (see the module docstring); yarn's attention factor is
    folded into both tables, as HF does.
    """
    scaling = scaling or RopeScaling()
    inv_freq = _device_inv_freq(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    factor = rope_attention_factor(scaling)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


@lru_cache(maxsize=32)
def _device_inv_freq(head_dim: int, theta: float, scaling: RopeScaling,
                     device: torch.device) -> torch.Tensor:
    """:func:`rope_inv_freq` on ``device``, made once: a forward does no host-to-device copy
    (on CUDA, a copy from pageable host memory waits for the stream)."""
    return rope_inv_freq(head_dim, theta, scaling).to(device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and rotations run in float32 for half inputs and in float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(batch, seq, heads, head_dim)`` by the tables.

    Half-split pairing: element ``m`` rotates with element ``m + head_dim / 2`` — HF's
    ``rotate_half``, so HF checkpoints' q/k projections load without a permutation.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    dtype = compute_dtype(x.dtype)
    cos, sin = cos[None, :, None, :].to(dtype), sin[None, :, None, :].to(dtype)
    return (x.to(dtype) * cos + rotated.to(dtype) * sin).to(x.dtype)
