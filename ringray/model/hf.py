"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3 and Mistral decoders.

    model = load_pretrained("ckpt/")                 # or an fsspec URL, e.g. s3://bucket/ckpt
    logits = model(tokens)
    save_pretrained(model, "out/")                   # transformers loads it back

A checkpoint directory holds ``config.json``, ``model.safetensors`` (or shards and
``model.safetensors.index.json``) and usually ``tokenizer.json`` with
``tokenizer_config.json``. :func:`config_from_hf` turns config.json into a
:class:`ModelConfig`, :func:`hf_parameter_names` names each of our parameters as the
checkpoint does, and :func:`load_hf_weights` copies tensors into an existing model one at a
time (a sharded loader reads single tensors or row ranges with
:class:`~ringray.model.safetensors_io.SafetensorsCheckpoint` instead).

HF stores q/k projections for its ``rotate_half`` RoPE (pairs ``m`` and ``m + head_dim/2``),
which is :func:`~ringray.model.rope.apply_rotary`'s convention too, so no permutation is
needed either way; ``tests/test_hf.py`` pins this with logits parity against transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import fsspec
import torch

from ringray.model.config import ModelConfig
from ringray.model.llama import Transformer
from ringray.model.rope import RopeScaling
from ringray.model.safetensors_io import (
    SafetensorsCheckpoint,
    join,
    read_json,
    write_safetensors,
)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral"}
"""Supported ``architectures`` values of config.json and their ``model_type``."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
"""Files copied from the source checkpoint by :func:`save_pretrained` when present."""

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""transformers' default shard size (5 GB)."""

_HF_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}

# Our module path inside a block -> HF's.
_BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# ------------------------------------------------------------------------------ config.json


def _architecture(hf: Mapping[str, object]) -> str:
    found = hf.get("architectures") or []
    supported = [a for a in found if a in ARCHITECTURES]
    if len(found) != 1 or not supported:
        raise ValueError(f"architectures: {found} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return supported[0]


def _required(hf: Mapping[str, object], key: str) -> object:
    if hf.get(key) is None:
        raise ValueError(f"{key}: missing from config.json")
    return hf[key]


def _rope_from_hf(hf: Mapping[str, object]) -> tuple[float, RopeScaling]:
    """``(theta, scaling)`` from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``; parameters HF defaults are filled in as HF does."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10_000.0)
    hf_type = params.get("rope_type", params.get("type", "default"))
    if hf_type not in _HF_ROPE_TYPES:
        raise ValueError(f"rope_type: {hf_type!r} is not supported; supported: "
                         f"{', '.join(_HF_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor: {partial} is not supported; expected 1.0")
    kind = _HF_ROPE_TYPES[hf_type]
    if kind == "none":
        return theta, RopeScaling()
    original = params.get("original_max_position_embeddings")
    if original is None and kind in ("llama3", "yarn"):
        original = hf.get("max_position_embeddings")  # HF's fallback
    factor = params.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = _required(hf, "max_position_embeddings") / original  # HF's fallback
    defaults = RopeScaling()
    return theta, RopeScaling(
        kind=kind,
        factor=float(_required(params, "factor") if factor is None else factor),
        original_max_position_embeddings=int(original) if original else None,
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        beta_fast=float(params.get("beta_fast") or defaults.beta_fast),
        beta_slow=float(params.get("beta_slow") or defaults.beta_slow),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def config_from_hf(hf: Mapping[str, object]) -> ModelConfig:
    """The :class:`ModelConfig` of a config.json (``ValueError`` naming the key on an
    unsupported architecture or feature)."""
    arch = _architecture(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf['hidden_act']!r} is not supported; expected 'silu'")
    window, sliding = _sliding_from_hf(hf, arch)
    dim, n_heads = int(_required(hf, "hidden_size")), int(_required(hf, "num_attention_heads"))
    head_dim = hf.get("head_dim")
    explicit = int(head_dim) if head_dim and head_dim * n_heads != dim else None
    bias = bool(hf.get("attention_bias", False))
    theta, scaling = _rope_from_hf(hf)
    return ModelConfig(
        vocab_size=int(_required(hf, "vocab_size")),
        dim=dim,
        n_layers=int(_required(hf, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        ffn_hidden=int(_required(hf, "intermediate_size")),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        explicit_head_dim=explicit,
        qkv_bias=True if arch == "Qwen2ForCausalLM" else bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else bias,
        mlp_bias=bool(hf.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        sliding_window=window,
        sliding_layers=sliding,
    )


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding_from_hf(hf: Mapping[str, object],
                     arch: str) -> tuple[int | None, tuple[int, ...] | None]:
    """``(sliding_window, sliding_layers)`` of a config.json: Qwen2/Qwen3's
    ``use_sliding_window`` with ``layer_types`` (or, without them, the layers from
    ``max_window_layers`` on, as transformers derives them); Mistral's ``sliding_window``
    (every layer; null: none); Llama has no window."""
    n_layers = int(_required(hf, "num_hidden_layers"))
    layer_types = list(hf.get("layer_types") or [])
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types: {unknown} is not supported; expected "
                         f"{' or '.join(_LAYER_TYPES)}")
    if arch == "LlamaForCausalLM":
        if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise ValueError("use_sliding_window: LlamaForCausalLM has no sliding window")
        return None, None
    if arch == "MistralForCausalLM":  # every layer, when the window is set
        sliding = list(range(n_layers)) if hf.get("sliding_window") is not None else []
    elif layer_types:
        if len(layer_types) != n_layers:
            raise ValueError(f"layer_types: {len(layer_types)} entries for "
                             f"num_hidden_layers={n_layers}")
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    elif hf.get("use_sliding_window"):
        first = hf.get("max_window_layers")
        sliding = list(range(int(first) if first is not None else 0, n_layers))
    else:
        sliding = []
    if not sliding:
        return None, None
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window: {window!r} with sliding-attention layers "
                         f"{sliding}; expected a positive whole number of keys")
    return window, (None if len(sliding) == n_layers else tuple(sliding))


def read_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint at ``path`` (its config.json only);
    ``ValueError`` in one line naming the file for anything that is not a supported one."""
    fs, local = fsspec.core.url_to_fs(path)
    if fs.isfile(local):
        raise ValueError(f"{path}: is a file; give the checkpoint's directory (the one that "
                         f"holds config.json, *.safetensors and tokenizer.json)")
    config_path = join(path, "config.json")
    hf = read_json(config_path)
    try:
        return config_from_hf(hf)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {config_path})") from None
    except (TypeError, AttributeError) as exc:  # a key holding a value of another JSON type
        raise ValueError(f"{config_path}: a value has the wrong JSON type ({exc})") from None


def _expressible(cfg: ModelConfig, arch: str) -> bool:
    if arch == "LlamaForCausalLM" and cfg.sliding_window is not None:
        return False  # Llama has no sliding window; Qwen2 and Qwen3 do
    if arch == "MistralForCausalLM":  # no biases; a window is on every layer or none
        return (not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
                and cfg.sliding_layers is None)
    if arch == "Qwen2ForCausalLM":
        return cfg.qkv_bias and not (cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    if arch == "Qwen3ForCausalLM":
        return cfg.qk_norm and cfg.qkv_bias == cfg.o_bias and not cfg.mlp_bias
    return not cfg.qk_norm and cfg.qkv_bias == cfg.o_bias


def hf_architecture(cfg: ModelConfig, preferred: str | None = None) -> str:
    """The HF architecture that expresses ``cfg`` (``preferred`` when it can)."""
    candidates = ([preferred] if preferred in ARCHITECTURES else []) + list(ARCHITECTURES)
    for arch in candidates:
        if _expressible(cfg, arch):
            return arch
    window = (f", sliding_window: {cfg.sliding_window} (not LlamaForCausalLM)"
              if cfg.sliding_window is not None else "")
    raise ValueError(f"qkv_bias: {cfg.qkv_bias}, o_bias: {cfg.o_bias}, mlp_bias: "
                     f"{cfg.mlp_bias} and qk_norm: {cfg.qk_norm}{window} together match none "
                     f"of {', '.join(ARCHITECTURES)}")


def _rope_to_hf(cfg: ModelConfig) -> dict[str, object]:
    s = cfg.rope_scaling
    params: dict[str, object] = {"rope_type": "default" if s.kind == "none" else s.kind,
                                 "rope_theta": cfg.rope_theta}
    if s.kind != "none":
        params["factor"] = s.factor
    if s.kind in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = s.original_max_position_embeddings
    if s.kind == "llama3":
        params.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.kind == "yarn":
        params.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(s, key) is not None:
                params[key] = getattr(s, key)
    return params


def config_to_hf(
    cfg: ModelConfig, *, base: Mapping[str, object] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, object]:
    """The config.json of ``cfg``: ``base``'s other keys (token ids, context length, ...)
    kept, its architecture kept when it can express ``cfg``.

    RoPE is written both as transformers 5's ``rope_parameters`` and as the older
    ``rope_theta`` + ``rope_scaling`` that other readers (vLLM, transformers 4) expect.
    """
    base = dict(base or {})
    preferred = (base.get("architectures") or [None])[0]
    arch = hf_architecture(cfg, preferred)
    rope = _rope_to_hf(cfg)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    s = cfg.rope_scaling
    longest = (round(s.original_max_position_embeddings * s.factor)
               if s.original_max_position_embeddings else 8192)
    out = {key: value for key, value in base.items()
           if key not in ("rope_scaling", "rope_theta", "rope_parameters", "torch_dtype")}
    out.update(
        architectures=[arch],
        model_type=ARCHITECTURES[arch],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=rope,
        rope_theta=cfg.rope_theta,
        rope_scaling=scaling if s.kind != "none" else None,
        max_position_embeddings=base.get("max_position_embeddings", longest),
        dtype=str(dtype).removeprefix("torch."),
    )
    if arch not in ("Qwen2ForCausalLM", "MistralForCausalLM"):
        out["attention_bias"] = cfg.qkv_bias
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = cfg.mlp_bias
    elif arch == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window  # every layer (null: none)
    else:
        types = ["sliding_attention" if cfg.layer_window(i) else "full_attention"
                 for i in range(cfg.n_layers)]
        out.update(use_sliding_window=cfg.sliding_window is not None, layer_types=types,
                   sliding_window=cfg.sliding_window)
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if sliding and sliding == list(range(sliding[0], cfg.n_layers)):
            out["max_window_layers"] = sliding[0]  # what transformers 4 reads instead
    return out


# ------------------------------------------------------------------------------ tensors


def hf_parameter_names(model: Transformer | ModelConfig) -> dict[str, str]:
    """Our parameter name -> the checkpoint's tensor name, for every parameter of ``model``
    (or of a model of this config); a tied output projection is the embedding table, so it
    has no entry of its own."""
    if isinstance(model, ModelConfig):
        with torch.device("meta"):
            model = Transformer(model)
    names = {}
    for name, _ in model.named_parameters():
        if name in _TOP_NAMES:
            names[name] = _TOP_NAMES[name]
            continue
        _, index, *module, leaf = name.split(".")
        names[name] = f"model.layers.{index}.{_BLOCK_NAMES['.'.join(module)]}.{leaf}"
    return names


def _ignorable(name: str, model: Transformer) -> bool:
    """Tensors a checkpoint may hold that carry nothing we need."""
    if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved RoPE's buffer
        return True
    return name == "lm_head.weight" and model.config.tie_embeddings


def check_hf_weights(model: Transformer | ModelConfig,
                     checkpoint: SafetensorsCheckpoint | str) -> None:
    """Raise ``ValueError`` (one line naming the tensor) unless the checkpoint holds exactly
    the tensors ``model`` (or a model of this config) needs, with its shapes: read from the
    safetensors headers only, so it is cheap enough to run before a job starts.
    """
    if isinstance(model, ModelConfig):
        with torch.device("meta"):
            model = Transformer(model)
    if isinstance(checkpoint, str):
        checkpoint = SafetensorsCheckpoint(checkpoint)
    names = hf_parameter_names(model)
    for hf_name in names.values():
        if hf_name not in checkpoint:
            raise ValueError(f"{hf_name}: missing from the checkpoint at {checkpoint.root}")
    unexpected = [n for n in checkpoint.names
                  if n not in set(names.values()) and not _ignorable(n, model)]
    if unexpected:
        raise ValueError(f"{unexpected[0]}: unexpected tensor in the checkpoint at "
                         f"{checkpoint.root} ({len(unexpected)} in all); the config.json does "
                         f"not describe it")
    params = dict(model.named_parameters())
    for name, hf_name in names.items():
        expected, found = tuple(params[name].shape), checkpoint.shape(hf_name)
        if found != expected:
            raise ValueError(f"{hf_name}: shape {list(found)} in the checkpoint, expected "
                             f"{list(expected)} from its config.json")


@torch.no_grad()
def load_hf_weights(model: Transformer, checkpoint: SafetensorsCheckpoint | str) -> None:
    """Copy every parameter of ``model`` from an HF checkpoint (cast to the parameter's
    dtype), reading one tensor at a time, after :func:`check_hf_weights`.

    Raises:
        ValueError: one line naming the tensor, for a tensor missing from the checkpoint, a
            shape that differs from the model's, a tensor the model has no place for, or a
            tensor holding a NaN or an infinity.
    """
    if isinstance(checkpoint, str):
        checkpoint = SafetensorsCheckpoint(checkpoint)
    check_hf_weights(model, checkpoint)
    params = dict(model.named_parameters())
    by_hf_name = {hf_name: params[name] for name, hf_name in hf_parameter_names(model).items()}
    for hf_name, tensor in checkpoint.tensors(by_hf_name):
        if not all_finite(tensor):
            raise ValueError(nonfinite_tensor_message(checkpoint.root, hf_name))
        by_hf_name[hf_name].copy_(tensor)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN and no infinity, by its minimum and maximum (a NaN
    makes both NaN, an infinity one of them): a reduction, with no temporary the size of the
    tensor (``isfinite`` would make several beside a shard being filled)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def nonfinite_tensor_message(root: str, hf_name: str) -> str:
    """One line refusing a pretrained checkpoint whose tensor ``hf_name`` is not finite."""
    return (f"{root}: tensor {hf_name} holds a NaN or an infinity; a model cannot train or "
            f"evaluate from it (a damaged file, or weights saved from a diverged run)")


def load_pretrained(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> Transformer:
    """The HF checkpoint at ``path`` (a directory or fsspec URL) as a :class:`Transformer`
    with parameters in ``dtype`` on the CPU.

    The model is built on the meta device and filled tensor by tensor, so its weights are
    materialised once. Raises ``ValueError`` (one line) on an unsupported architecture, a
    missing or unexpected tensor, or a shape mismatch.
    """
    path = os.fspath(path).rstrip("/") or "/"
    cfg = read_model_config(path)
    checkpoint = SafetensorsCheckpoint(path)
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the two names separate tensors
    load_hf_weights(model, checkpoint)
    model.pretrained_source = path
    return model


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike[str],
    *,
    source: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config_overrides: Mapping[str, object] | None = None,
) -> None:
    """Write ``model`` as an HF checkpoint that ``transformers`` (and :func:`load_pretrained`)
    load: config.json, safetensors (sharded above ``max_shard_bytes``) and the tokenizer.

    ``source`` (default: the checkpoint ``model`` was loaded from, if any) provides the
    tokenizer files to copy and the config.json keys ringray does not model (token ids,
    ``max_position_embeddings``, ...). ``config_overrides`` are written last, e.g.
    ``{"max_position_embeddings": 131072}`` after extending the context. ``dtype`` casts the
    weights (e.g. ``torch.bfloat16`` for release); default: the parameters' own.
    """
    save_hf_checkpoint(
        dict(model.named_parameters()), model.config, os.fspath(path),
        source=source if source is not None else model.pretrained_source, dtype=dtype,
        max_shard_bytes=max_shard_bytes, config_overrides=config_overrides,
    )


def save_hf_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config: ModelConfig,
    path: str,
    *,
    source: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config_overrides: Mapping[str, object] | None = None,
    load: Callable[[list[str]], Mapping[str, torch.Tensor]] | None = None,
) -> None:
    """:func:`save_pretrained` from a state dict by our parameter names: a model's, or the
    full (gathered, plain-tensor) state dict of an FSDP-sharded one, on the rank that
    writes. Extra entries (a tied ``output.weight``) are ignored.

    ``load``: stream the weights one safetensors shard at a time. ``state_dict`` then only
    gives shapes and dtypes (meta tensors), and ``load(names)`` returns those parameters'
    tensors by our names; what is held at once is one shard (``max_shard_bytes``), not the
    model (``ringray export`` reads a checkpoint this way)."""
    names = hf_parameter_names(config)
    missing = [name for name in names if name not in state_dict]
    if missing:
        raise ValueError(f"state_dict: {missing[0]} is missing ({len(missing)} in all)")
    ours = {hf_name: name for name, hf_name in names.items()}
    saved_dtype = dtype or state_dict[next(iter(names))].dtype
    shapes = {hf_name: torch.empty(state_dict[name].shape, device="meta",
                                   dtype=dtype or state_dict[name].dtype)
              for name, hf_name in names.items()}

    def shard(hf_names: list[str]) -> dict[str, torch.Tensor]:
        part = (load([ours[n] for n in hf_names]) if load is not None
                else {ours[n]: state_dict[ours[n]] for n in hf_names})
        return {n: part[ours[n]].detach().to("cpu", dtype or part[ours[n]].dtype)
                for n in hf_names}

    base = read_json(join(source, "config.json")) if source is not None else None
    write_safetensors(shapes, path, max_shard_bytes=max_shard_bytes, load=shard)
    hf_config = config_to_hf(config, base=base, dtype=saved_dtype)
    hf_config.update(config_overrides or {})
    fs, root = fsspec.core.url_to_fs(path)
    with fs.open(f"{root.rstrip('/')}/config.json", "w") as f:
        f.write(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if source is not None:
        source_fs, source_root = fsspec.core.url_to_fs(source)
        for name in TOKENIZER_FILES:
            from_path = f"{source_root.rstrip('/')}/{name}"
            if source_fs.exists(from_path):
                with fs.open(f"{root.rstrip('/')}/{name}", "wb") as f:
                    f.write(source_fs.cat_file(from_path))
