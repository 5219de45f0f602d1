"""A Llama/Qwen-style decoder whose attention goes round the ring (no Ray, no pydantic), and
Hugging Face checkpoints in and out.

    from ringray.model import Transformer, RingContext, model_preset
    from ringray.model import load_pretrained, save_pretrained
"""

from ringray.model.config import MODEL_PRESETS, ModelConfig, model_preset
from ringray.model.hf import (
    ARCHITECTURES,
    all_finite,
    check_hf_weights,
    config_from_hf,
    config_to_hf,
    hf_parameter_names,
    load_hf_weights,
    load_pretrained,
    nonfinite_tensor_message,
    read_model_config,
    save_hf_checkpoint,
    save_pretrained,
)
from ringray.model.llama import RingContext, Transformer
from ringray.model.options import ModelOptions, RopeOptions
from ringray.model.rope import (
    ROPE_SCALING_KINDS,
    RopeScaling,
    apply_rotary,
    rope_attention_factor,
    rope_inv_freq,
    rotary_tables,
)
from ringray.model.safetensors_io import SafetensorsCheckpoint, write_safetensors

__all__ = [
    "all_finite",
    "ARCHITECTURES",
    "check_hf_weights",
    "MODEL_PRESETS",
    "ROPE_SCALING_KINDS",
    "ModelConfig",
    "ModelOptions",
    "RingContext",
    "RopeOptions",
    "RopeScaling",
    "SafetensorsCheckpoint",
    "Transformer",
    "apply_rotary",
    "config_from_hf",
    "config_to_hf",
    "hf_parameter_names",
    "load_hf_weights",
    "load_pretrained",
    "nonfinite_tensor_message",
    "model_preset",
    "read_model_config",
    "rope_attention_factor",
    "rope_inv_freq",
    "rotary_tables",
    "save_hf_checkpoint",
    "save_pretrained",
    "write_safetensors",
]
