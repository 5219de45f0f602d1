"""Model shapes: one frozen dataclass and named presets.

    cfg = model_preset("debug")                     # seconds on a CPU
    cfg = model_preset("1b", n_layers=8)            # a preset with overrides

Presets go from ``debug`` (trains end to end on CPU in CI) to ``1b`` and ``8b``, whose
shapes follow the Llama 3.2 1B and Llama 3 8B decoders (defined here, run on GPUs). The
vocabulary is the byte-level tokenizer's (:class:`ringray.data.ByteTokenizer`), so the
embedding tables are small and the parameter counts are almost all transformer blocks.

A job spec's ``model`` section (a preset or a pretrained checkpoint, with overrides) is
:class:`ringray.model.options.ModelOptions`, which builds one of these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

from ringray.model.rope import RopeScaling


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
    sliding_window: int | None = None
    """Sliding-window attention (Mistral; Qwen2/Qwen3's ``use_sliding_window``): a query sees
    the last ``sliding_window`` keys, itself included, on the layers ``sliding_layers``
    names; None: full causal attention on every layer."""
    sliding_layers: tuple[int, ...] | None = None
    """The layers with the window (Hugging Face's ``layer_types``); None: every layer."""

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

        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {self.sliding_window}")
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise ValueError("sliding_layers: given without a sliding_window; give the "
                                 "window, or drop sliding_layers")
            outside = [i for i in self.sliding_layers if not 0 <= i < self.n_layers]
            if outside:
                raise ValueError(f"sliding_layers: {outside} are not layers of this model "
                                 f"(0 to {self.n_layers - 1})")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None

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
        if values.get("sliding_layers") is not None:
            values["sliding_layers"] = tuple(values["sliding_layers"])
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
     "rope_scaling", "sliding_window", "sliding_layers")
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
    # Llama 3 70B block shapes (about 68.5B parameters with the byte vocabulary); planned and
    # simulated here, never built for real.
    "70b": ModelConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, rope_theta=500_000.0
    ),
}


def model_preset(name: str, **overrides: object) -> ModelConfig:
    """The preset ``name`` with ``overrides`` applied (validated like any ModelConfig)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; valid: {sorted(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[name], **overrides)
