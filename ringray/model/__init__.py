"""A Llama-style decoder whose attention goes round the ring (no Ray, no pydantic).

    from ringray.model import Transformer, RingContext, model_preset
"""

from ringray.model.config import MODEL_PRESETS, ModelConfig, ModelOptions, model_preset
from ringray.model.llama import RingContext, Transformer, apply_rotary, rotary_tables

__all__ = [
    "MODEL_PRESETS",
    "ModelConfig",
    "ModelOptions",
    "RingContext",
    "Transformer",
    "apply_rotary",
    "model_preset",
    "rotary_tables",
]
