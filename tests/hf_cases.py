"""Tiny Hugging Face checkpoints made locally with transformers (random weights, nothing
downloaded), shared by the HF tests, and the rank function the gloo launcher runs for the
ring parity test (so it lives in an importable module)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringray.attention import make_layout
from ringray.model import RingContext, hf_parameter_names, load_pretrained

SEQ = 64
VOCAB = 96
_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ,
              rms_norm_eps=1e-6)

# name -> (architecture, config keyword arguments). Each one exercises different features;
# the RoPE scalings use an original context (16) shorter than SEQ so that they matter.
CASES: dict[str, tuple[str, dict]] = {
    "llama3_tied": ("llama", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})),
    "llama_yarn": ("llama", dict(
        max_position_embeddings=4 * 16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16})),
    "llama_linear_biases": ("llama", dict(
        attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0})),
    "qwen2_biases": ("qwen2", dict(rope_parameters={"rope_type": "default",
                                                    "rope_theta": 1_000_000.0})),
    "qwen3_qk_norm": ("qwen3", dict(head_dim=16, attention_bias=True,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 1_000_000.0})),
    # Layer 1 only: a sliding window of 5 keys (transformers' layer_types from
    # max_window_layers), shorter than the ring's blocks (64 / 8 = 8 tokens over 4 ranks).
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                    max_window_layers=1,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 10_000.0})),
    # Mistral: a window of 5 keys on every layer.
    "mistral_sliding": ("mistral", dict(sliding_window=5, head_dim=8,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 10_000.0})),
}


def _randomize_(model: torch.nn.Module, *, std: float) -> None:
    """Norm weights in [0.5, 1.5], every other weight N(0, std²): large enough that a wrong
    mapping, rotation, scaling or position shows (HF would set norms to one)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std)


def hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    """A transformers model of ``case`` with random weights large enough that a wrong
    mapping, rotation or scaling shows in the logits (HF would zero biases and set norms to
    one)."""
    import transformers

    arch, kwargs = CASES[case]
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    config = config_class(**{**_SHAPE, **kwargs})
    config._attn_implementation = "sdpa"  # exact in float32 (eager's softmax is float32 too)
    torch.manual_seed(seed)
    model = model_class(config)
    _randomize_(model, std=0.1)
    return model.eval()


def save_hf_case(case: str, directory: Path, *, old_rope_spelling: bool = False) -> Path:
    """Save ``case`` with ``save_pretrained`` under ``directory / case``.

    ``old_rope_spelling`` rewrites config.json's RoPE as transformers 4 wrote it (top-level
    ``rope_theta`` and ``rope_scaling``), as in Llama 3.1's published config.json.
    """
    path = directory / case
    hf_model(case).save_pretrained(path)
    if old_rope_spelling:
        config_path = path / "config.json"
        config = json.loads(config_path.read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        config_path.write_text(json.dumps(config))
    return path


def case_tokens(seed: int = 1) -> torch.Tensor:
    """``(2, SEQ + 1)`` random token ids: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, count: int) -> torch.Tensor:
    """Summed cross entropy over ``logits``' tokens divided by ``count`` (all tokens of the
    ring), so the ranks' losses add up to the whole sequence's mean."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / count


def rank_ring_logits_and_grads(rank: int, world: int, paths: list[str]) -> list[dict]:
    """For each checkpoint: this rank's logits over a zigzag ring of ``world`` ranks, and the
    gradient of the whole sequence's mean cross entropy by HF parameter name (summed over
    the ring, returned by rank 0)."""
    tokens = case_tokens()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    layout = make_layout("zigzag", world, SEQ)
    results = []
    for path in paths:
        model = load_pretrained(path)
        ring = RingContext(layout=layout, rank=rank, backend="sdpa")
        logits = model(layout.shard(inputs, rank), ring)
        loss = mean_cross_entropy(logits, layout.shard(targets, rank), targets.numel())
        loss.backward()
        names = hf_parameter_names(model)
        grads = {}
        for name, param in model.named_parameters():
            dist.all_reduce(param.grad)
            grads[names[name]] = param.grad
        results.append({"logits": logits.detach(), "grads": grads if rank == 0 else None})
    return results


MULTI_DIGIT_TOKENS = ("12", "34", "345")
"""Merged tokens of :func:`tiny_tokenizer`: ``"12345"`` encodes as ``12`` ``345``."""


def tiny_tokenizer(*, with_eos: bool = True):
    """A byte-level BPE ``tokenizers.Tokenizer`` built here: the 256 byte symbols, merges
    that make the multi-digit tokens ``12``, ``34``, ``345``, and specials
    ``<|begin_of_text|>`` and (unless ``with_eos`` is false) ``<|end_of_text|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in MULTI_DIGIT_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2"), ("3", "4"), ("34", "5")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>"] + (["<|end_of_text|>"] if with_eos else []))
    return tokenizer


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def write_tokenizer(directory: Path, *, with_eos: bool = True) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (EOS/BOS, chat template) of
    :func:`tiny_tokenizer` in ``directory``, as a Hugging Face checkpoint holds them."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer(with_eos=with_eos).save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "chat_template": CHAT_TEMPLATE}
    if with_eos:
        config["eos_token"] = {"content": "<|end_of_text|>", "special": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny_llama(path: Path, tokenizer, *, positions: int) -> None:
    """A random 2-layer Llama (GQA, untied, sdpa) over ``tokenizer`` (a
    ``tokenizers.Tokenizer`` holding ``<|begin_of_text|>`` and ``<|end_of_text|>``), saved
    with ``save_pretrained`` under ``path`` with a tokenizer that prepends BOS, as an lm_eval
    ``pretrained`` directory. Weights large enough that a wrong position shows."""
    import transformers
    from tokenizers import processors

    bos = tokenizer.token_to_id("<|begin_of_text|>")
    eos = tokenizer.token_to_id("<|end_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    path.mkdir(parents=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>"}))
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=positions, rms_norm_eps=1e-6, bos_token_id=bos,
        eos_token_id=eos, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _randomize_(model, std=0.3)
    model.save_pretrained(path)
