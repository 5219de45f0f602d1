"""Model shapes: one frozen dataclass and named presets.

    cfg = model_preset("debug")                     # seconds on a CPU
    cfg = model_preset("1b", n_layers=8)            # a preset with overrides
    cfg = ModelOptions(preset="1b", n_layers=8).build()   # the same, as a job spec says it

Presets go from ``debug`` (trains end to end on CPU in CI) to ``1b`` and ``8b``, whose
shapes follow the Llama 3.2 1B and Llama 3 8B decoders (defined here, run on GPUs). The
vocabulary is the byte-level tokenizer's (:class:`ringray.data.ByteTokenizer`), so the
embedding tables are small and the parameter counts are almost all transformer blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Annotated, Literal

from annotated_types import Ge, Gt


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a Llama-style decoder."""

    vocab_size: int = 320
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 384
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"dim: {self.dim} is not divisible by n_heads={self.n_heads} "
                f"(head_dim = dim / n_heads must be a whole number)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads: n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention needs whole groups)"
            )
        if self.head_dim % 2:
            raise ValueError(f"dim: head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (``embeddings=False`` leaves out the input table, as MFU does)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_hidden
        per_layer = attn + mlp + 2 * self.dim  # two RMSNorm weights
        total = self.n_layers * per_layer + self.dim + self.vocab_size * self.dim  # + output
        return total + (self.vocab_size * self.dim if embeddings else 0)

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward) at ``seq_len``.

        Matmuls with weights cost 6 FLOPs per parameter per token. Attention scores and the
        weighted sum cost ``4 * seq_len * n_heads * head_dim`` forward FLOPs per token per
        layer for full attention; causal attention does half of that work.
        """
        dense = 6.0 * self.num_params(embeddings=False)
        attn_fwd = 4.0 * seq_len * self.n_heads * self.head_dim * self.n_layers
        return dense + 3.0 * attn_fwd * (0.5 if causal else 1.0)


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


def model_preset(name: str, **overrides: int | float) -> ModelConfig:
    """The preset ``name`` with ``overrides`` applied (validated like any ModelConfig)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; valid: {sorted(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[name], **overrides)


PresetName = Literal[tuple(MODEL_PRESETS)]


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Which decoder a job trains (the job spec's ``model`` section): a preset, with any of its
    shape fields overridden. Unset fields keep the preset's value."""

    preset: PresetName = "debug"
    """Model shape preset (debug: seconds on a CPU; small; 1b and 8b: Llama 3 block shapes)."""
    dim: Annotated[int, Ge(1)] | None = None
    """Hidden size (default: the preset's); a multiple of n_heads with an even head size."""
    n_layers: Annotated[int, Ge(1)] | None = None
    """Decoder blocks (default: the preset's)."""
    n_heads: Annotated[int, Ge(1)] | None = None
    """Query heads (default: the preset's)."""
    n_kv_heads: Annotated[int, Ge(1)] | None = None
    """Key/value heads; n_heads must be a multiple (GQA/MQA)."""
    ffn_hidden: Annotated[int, Ge(1)] | None = None
    """SwiGLU hidden size."""
    rope_theta: Annotated[float, Gt(0)] | None = None
    """Rotary embedding base."""

    def overrides(self) -> dict[str, int | float]:
        """The shape fields this job sets, by :class:`ModelConfig` field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "preset" and getattr(self, f.name) is not None}

    def build(self) -> ModelConfig:
        """The preset with the overrides (raises ``ValueError`` naming a field that does not
        fit, e.g. ``dim: 100 is not divisible by n_heads=8 ...``)."""
        return model_preset(self.preset, **self.overrides())
