"""Model shapes: one frozen dataclass, named presets, and the job spec's model options.

    cfg = model_preset("debug")                     # seconds on a CPU
    cfg = model_preset("1b", n_layers=8)            # a preset with overrides
    cfg = ModelOptions(preset="1b", n_layers=8).build()   # the same, as a job spec says it

    cfg = ModelOptions(from_pretrained="ckpt/", rope=RopeOptions(scaling="yarn", factor=4.0,
                       original_max_position_embeddings=8192)).build()   # longer context

Presets go from ``debug`` (trains end to end on CPU in CI) to ``1b`` and ``8b``, whose
shapes follow the Llama 3.2 1B and Llama 3 8B decoders (defined here, run on GPUs). The
vocabulary is the byte-level tokenizer's (:class:`ringray.data.ByteTokenizer`), so the
embedding tables are small and the parameter counts are almost all transformer blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Literal

import fsspec
from annotated_types import Ge, Gt, MinLen

from ringray.model.rope import ROPE_SCALING_KINDS, RopeScaling, RopeScalingKind


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and features of a Llama/Qwen-style decoder.

    The first fields are the shape every preset sets. The feature fields after them describe
    pretrained families (Qwen2's q/k/v biases, Qwen3's q/k norms and explicit head size,
    Llama 3.2's tied embeddings, Llama 3.1's RoPE scaling); they default to off.
    """

    vocab_size: int = 320
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 384
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    explicit_head_dim: int | None = None
    """Per-head size when it is not ``dim / n_heads`` (Qwen3); None: ``dim / n_heads``."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2; Llama's ``attention_bias``)."""
    o_bias: bool = False
    """A bias on the attention output projection (Llama's and Qwen3's ``attention_bias``)."""
    mlp_bias: bool = False
    """Biases on the SwiGLU projections (Llama's ``mlp_bias``)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before the rotation (Qwen3)."""
    tie_embeddings: bool = False
    """The output projection is the input embedding table (Llama 3.2 1B/3B, small Qwens)."""
    rope_scaling: RopeScaling = RopeScaling()
    """How rotary frequencies are stretched for long context (default: not at all)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a positive number, got {value}")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling: expected a RopeScaling, got "
                             f"{type(self.rope_scaling).__name__}")
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim: {self.dim} is not divisible by n_heads={self.n_heads} "
                f"(head_dim = dim / n_heads must be a whole number)"
            )
        if self.explicit_head_dim is not None and self.explicit_head_dim < 1:
            raise ValueError(f"explicit_head_dim: must be >= 1, got {self.explicit_head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads: n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention needs whole groups)"
            )
        if self.head_dim % 2:
            field_name = "dim" if self.explicit_head_dim is None else "explicit_head_dim"
            raise ValueError(
                f"{field_name}: head_dim={self.head_dim} must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    def to_dict(self) -> dict:
        """Plain JSON-ready fields. Feature fields at their defaults are left out, so a model
        without them has the same dict as before they existed (checkpoints compare these)."""
        out = asdict(self)
        for f in fields(self):
            if f.name in _FEATURE_FIELDS and getattr(self, f.name) == f.default:
                del out[f.name]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ModelConfig:
        """The inverse of :meth:`to_dict`."""
        values = dict(data)
        if isinstance(values.get("rope_scaling"), Mapping):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        return cls(**values)

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (``embeddings=False`` leaves out the input table, as MFU does).

        With tied embeddings the one table is also the output projection, which every
        token is multiplied by, so it is counted once either way.
        """
        e, h, k = self.head_dim, self.n_heads, self.n_kv_heads
        attn = self.dim * e * (2 * h + 2 * k)
        attn += (h + 2 * k) * e * self.qkv_bias + self.dim * self.o_bias + 2 * e * self.qk_norm
        mlp = 3 * self.dim * self.ffn_hidden + (2 * self.ffn_hidden + self.dim) * self.mlp_bias
        per_layer = attn + mlp + 2 * self.dim  # two RMSNorm weights
        table = self.vocab_size * self.dim
        total = self.n_layers * per_layer + self.dim + table  # final norm, output
        return total + (table if embeddings and not self.tie_embeddings else 0)

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward) at ``seq_len``.

        Matmuls with weights cost 6 FLOPs per parameter per token. Attention scores and the
        weighted sum cost ``4 * seq_len * n_heads * head_dim`` forward FLOPs per token per
        layer for full attention; causal attention does half of that work.
        """
        dense = 6.0 * self.num_params(embeddings=False)
        attn_fwd = 4.0 * seq_len * self.n_heads * self.head_dim * self.n_layers
        return dense + 3.0 * attn_fwd * (0.5 if causal else 1.0)


_FEATURE_FIELDS = frozenset(
    ("explicit_head_dim", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_embeddings",
     "rope_scaling")
)
"""ModelConfig fields added after checkpoints recorded ``to_dict()``: omitted at defaults."""


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Trains in seconds on a CPU; what CI and the quickstart use.
    "debug": ModelConfig(),
    # A few minutes per hundred steps on a CPU at short context; a laptop-sized sanity model.
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536),
    # Llama 3.2 1B block shapes (about 1.0B parameters with the byte vocabulary).
    "1b": ModelConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, rope_theta=500_000.0
    ),
    # Llama 3 8B block shapes (about 7.0B parameters with the byte vocabulary).
    "8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, rope_theta=500_000.0
    ),
}


def model_preset(name: str, **overrides: object) -> ModelConfig:
    """The preset ``name`` with ``overrides`` applied (validated like any ModelConfig)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; valid: {sorted(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[name], **overrides)


PresetName = Literal[tuple(MODEL_PRESETS)]


@dataclass(frozen=True, kw_only=True)
class RopeOptions:
    """Rotary embedding overrides (the job spec's ``model.rope``), e.g. to extend a pretrained
    model's context: ``{scaling: yarn, factor: 4, original_max_position_embeddings: 8192}``.
    Unset fields keep the model's value; when ``scaling`` changes the kind, unset scaling
    parameters take the new kind's defaults."""

    theta: Annotated[float, Gt(0)] | None = None
    """Rotary base (default: the model's); the same as model.rope_theta."""
    scaling: RopeScalingKind | None = None
    """Frequency scaling: 'none', 'linear' (position interpolation), 'llama3' (Llama 3.1) or
    'yarn' (YaRN) (default: the model's)."""
    factor: Annotated[float, Ge(1)] | None = None
    """Context extension factor of the scaling (linear, llama3, yarn)."""
    original_max_position_embeddings: Annotated[int, Ge(1)] | None = None
    """Context length the model was pretrained at (llama3 and yarn need it)."""
    low_freq_factor: Annotated[float, Gt(0)] | None = None
    """llama3: wavelengths above original / low_freq_factor are divided by factor (HF: 1)."""
    high_freq_factor: Annotated[float, Gt(0)] | None = None
    """llama3: wavelengths below original / high_freq_factor are kept (HF: 4)."""
    beta_fast: Annotated[float, Gt(0)] | None = None
    """yarn: rotations at the original length where interpolation starts to fade in (32)."""
    beta_slow: Annotated[float, Gt(0)] | None = None
    """yarn: rotations at the original length below which frequencies are fully
    interpolated (1)."""
    attention_factor: Annotated[float, Gt(0)] | None = None
    """yarn: multiplier of cos and sin (default: 0.1 ln(factor) + 1)."""

    def apply(self, theta: float, scaling: RopeScaling) -> tuple[float, RopeScaling]:
        """``(theta, scaling)`` with these overrides applied; ``ValueError`` naming the
        ``rope.`` field when the result is not a valid scaling."""
        kind = self.scaling if self.scaling is not None else scaling.kind
        base = scaling if kind == scaling.kind else RopeScaling()
        changes = {f.name: getattr(self, f.name) for f in fields(self)
                   if f.name not in ("theta", "scaling") and getattr(self, f.name) is not None}
        if kind == "none" and changes:
            raise ValueError(f"rope.{min(changes)}: has no effect without a scaling kind; set "
                             f"rope.scaling to one of {', '.join(ROPE_SCALING_KINDS[1:])}")
        if kind != base.kind and kind in ("llama3", "yarn"):
            # A kind that needs the pretraining length keeps the model's, if it had one.
            changes.setdefault("original_max_position_embeddings",
                               scaling.original_max_position_embeddings)
        try:
            new_scaling = replace(base, kind=kind, **changes)
        except ValueError as exc:
            raise ValueError(f"rope.{exc}") from None
        return (self.theta if self.theta is not None else theta), new_scaling


ShapeOverride = Annotated[int, Ge(1)] | None


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Which decoder a job trains (the job spec's ``model`` section): a preset, with any of its
    shape fields overridden, or a Hugging Face checkpoint (``from_pretrained``); either with
    RoPE overrides. Unset fields keep the preset's (or checkpoint's) value."""

    preset: PresetName = "debug"
    """Model shape preset (debug: seconds on a CPU; small; 1b and 8b: Llama 3 block shapes)."""
    dim: ShapeOverride = None
    """Hidden size (default: the preset's); a multiple of n_heads with an even head size."""
    n_layers: ShapeOverride = None
    """Decoder blocks (default: the preset's)."""
    n_heads: ShapeOverride = None
    """Query heads (default: the preset's)."""
    n_kv_heads: ShapeOverride = None
    """Key/value heads; n_heads must be a multiple (GQA/MQA)."""
    ffn_hidden: ShapeOverride = None
    """SwiGLU hidden size."""
    rope_theta: Annotated[float, Gt(0)] | None = None
    """Rotary embedding base (the same as rope.theta; give one of them)."""
    from_pretrained: Annotated[str, MinLen(1)] | None = None
    """A Hugging Face checkpoint (directory or fsspec URL with config.json, *.safetensors and
    tokenizer.json) to start from: Llama, Qwen2 or Qwen3. Its config.json gives the shape
    (preset and shape fields must be unset); rope overrides still apply."""
    rope: RopeOptions = field(default_factory=RopeOptions)
    """Rotary embedding overrides, e.g. to extend the context of a pretrained model."""

    def __post_init__(self) -> None:
        if self.rope_theta is not None and self.rope.theta is not None:
            raise ValueError(f"rope_theta: {self.rope_theta} and rope.theta: {self.rope.theta} "
                             f"both set the rotary base; give one of them")
        if self.from_pretrained is None:
            return
        if "://" in self.from_pretrained:
            scheme = self.from_pretrained.split("://", 1)[0]
            if scheme not in fsspec.available_protocols():
                raise ValueError(f"from_pretrained: {self.from_pretrained!r} has a URL scheme "
                                 f"{scheme!r} that fsspec does not know; use a local path or "
                                 f"one of fsspec's, e.g. s3://, gs://, file://")
        shape = sorted(self.overrides())
        if shape or self.preset != "debug":
            named = shape or [f"preset={self.preset!r}"]
            raise ValueError(f"from_pretrained: the checkpoint's config.json gives the shape; "
                             f"remove {', '.join(named)} (or from_pretrained)")

    def overrides(self) -> dict[str, int]:
        """The shape fields this job sets, by :class:`ModelConfig` field name."""
        names = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def build(self) -> ModelConfig:
        """The preset with the overrides, or the checkpoint's config, with the RoPE overrides
        (raises ``ValueError`` naming a field that does not fit, e.g. ``dim: 100 is not
        divisible by n_heads=8 ...``)."""
        if self.from_pretrained is not None:
            # hf imports this module (for ModelConfig), so it is imported where it is needed.
            from ringray.model.hf import read_model_config

            try:
                base = read_model_config(self.from_pretrained)
            except ValueError as exc:
                raise ValueError(f"from_pretrained: {exc}") from None
        else:
            base = model_preset(self.preset, **self.overrides())
        rope = replace(self.rope, theta=self.rope.theta or self.rope_theta)
        theta, scaling = rope.apply(base.rope_theta, base.rope_scaling)
        return replace(base, rope_theta=theta, rope_scaling=scaling)
