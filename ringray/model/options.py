"""The job spec's ``model`` section: which decoder a job trains, as options that build a
:class:`~ringray.model.config.ModelConfig`.

    cfg = ModelOptions(preset="1b", n_layers=8).build()    # model_preset("1b", n_layers=8)
    cfg = ModelOptions(from_pretrained="ckpt/", rope=RopeOptions(scaling="yarn", factor=4.0,
                       original_max_position_embeddings=8192)).build()   # longer context

This module sits above :mod:`ringray.model.hf` because building from a checkpoint reads its
config.json (local or through fsspec); the shapes themselves (:mod:`ringray.model.config`)
know nothing of files.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Literal

import fsspec
from annotated_types import Ge, Gt, MinLen

from ringray.model.config import MODEL_PRESETS, ModelConfig, model_preset
from ringray.model.hf import read_model_config
from ringray.model.rope import ROPE_SCALING_KINDS, RopeScaling, RopeScalingKind

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
    """Context extension factor of the scaling (linear, llama3, yarn); required when
    rope.scaling sets a kind other than the model's (it would otherwise mean 1)."""
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
        if kind != scaling.kind and kind != "none" and self.factor is None:
            # A new kind would start from factor 1: an extension that extends nothing.
            raise ValueError(f"rope.factor: not set; rope.scaling: {kind} (the model's is "
                             f"{scaling.kind}) needs the context extension factor, e.g. "
                             f"rope.factor: 4 for four times the pretraining length")
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
    """Model shape preset (debug: seconds on a CPU; small; 1b, 8b and 70b: Llama 3 block shapes)."""
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
    tokenizer.json) to start from: Llama, Qwen2, Qwen3 or Mistral. Its config.json gives the shape
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
            try:
                base = read_model_config(self.from_pretrained)
            except ValueError as exc:
                raise ValueError(f"from_pretrained: {exc}") from None
        else:
            base = model_preset(self.preset, **self.overrides())
        rope = replace(self.rope, theta=self.rope.theta or self.rope_theta)
        theta, scaling = rope.apply(base.rope_theta, base.rope_scaling)
        return replace(base, rope_theta=theta, rope_scaling=scaling)
