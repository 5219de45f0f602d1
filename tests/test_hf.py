"""Hugging Face checkpoints in and out, against transformers itself (tiny models with random
weights made locally; nothing downloaded).

- Logits parity (float32, atol = rtol = 1e-5) for Llama with llama3 scaling and tied
  embeddings (config.json in transformers 4's ``rope_scaling`` spelling), Llama with yarn,
  Llama with linear scaling and q/k/v/o and MLP biases, Qwen2 (q/k/v biases), Qwen3 (q/k
  norms, explicit head_dim): in one process, and over a zigzag ring of 4 gloo ranks, with
  the gradients of a loss on the logits too. HF's q/k layout loads without a permutation.
- Round trips: transformers -> load_pretrained -> save_pretrained -> transformers gives the
  same tensors and logits, single-file and sharded, locally and on an fsspec filesystem.
- A broken checkpoint is refused with one line naming the tensor or key.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import fsspec
import pytest
import torch
from distributed import run_gloo_ranks
from hf_cases import (
    CASES,
    SEQ,
    case_tokens,
    hf_model,
    mean_cross_entropy,
    rank_ring_logits_and_grads,
    save_hf_case,
    write_tokenizer,
)
from safetensors.torch import load_file, save_file

from ringray.attention import make_layout
from ringray.model import (
    ARCHITECTURES,
    RopeScaling,
    SafetensorsCheckpoint,
    Transformer,
    config_from_hf,
    hf_parameter_names,
    load_pretrained,
    read_model_config,
    save_pretrained,
)

F32_TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; more only contend (0.2 s a forward on 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case saved by transformers, with a tokenizer beside it; Llama 3.1's case with
    its config.json in the older ``rope_theta`` + ``rope_scaling`` spelling."""
    directory = tmp_path_factory.mktemp("hf")
    paths = {}
    for case in CASES:
        paths[case] = save_hf_case(case, directory, old_rope_spelling=case == "llama3_tied")
        write_tokenizer(paths[case])
    return paths


def hf_logits_and_grads(case: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits for :func:`case_tokens` and the gradients of their mean cross
    entropy, by HF parameter name."""
    model = hf_model(case)
    tokens = case_tokens()
    logits = model(input_ids=tokens[:, :-1]).logits
    mean_cross_entropy(logits, tokens[:, 1:], tokens[:, 1:].numel()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_grads_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Every HF parameter has our gradient (a tied lm_head is the embedding's), equal within
    atol 1e-5 relative to the tensor's largest entry and rtol 1e-5."""
    assert set(ours) == set(theirs) - {"lm_head.weight"} or set(ours) == set(theirs)
    for name, grad in ours.items():
        scale = theirs[name].abs().max().item()
        torch.testing.assert_close(grad, theirs[name], atol=1e-5 * scale, rtol=1e-5,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_match_transformers(case: str, checkpoints: dict) -> None:
    """One process, ``model(tokens)`` (no ring): logits, then the gradient of every
    parameter, equal transformers' for the same checkpoint (float32, 1e-5)."""
    model = load_pretrained(str(checkpoints[case]))
    hf_logits, hf_grads = hf_logits_and_grads(case)
    tokens = case_tokens()
    logits = model(tokens[:, :-1])
    torch.testing.assert_close(logits, hf_logits, **F32_TOL)
    mean_cross_entropy(logits, tokens[:, 1:], tokens[:, 1:].numel()).backward()
    names = hf_parameter_names(model)
    assert_grads_close({names[n]: p.grad for n, p in model.named_parameters()}, hf_grads)


def test_ring_of_four_matches_transformers(checkpoints: dict) -> None:
    """Each case over a zigzag ring of 4 gloo processes: the ranks' logits, put back in
    sequence order, and the ring-summed gradients equal transformers' (float32, 1e-5)."""
    cases = list(CASES)
    results = run_gloo_ranks(4, rank_ring_logits_and_grads,
                             [str(checkpoints[c]) for c in cases], timeout_seconds=240)
    layout = make_layout("zigzag", 4, SEQ)
    for i, case in enumerate(cases):
        hf_logits, hf_grads = hf_logits_and_grads(case)
        logits = layout.unshard([results[rank][i]["logits"] for rank in range(4)])
        torch.testing.assert_close(logits, hf_logits, **F32_TOL, msg=lambda m, c=case: f"{c}: {m}")
        assert_grads_close(results[0][i]["grads"], hf_grads)


def test_parity_would_catch_a_wrong_rotation_or_scaling(checkpoints: dict) -> None:
    """The parity tests can fail: permuting q/k into the interleaved RoPE layout, dropping
    the llama3 scaling, or a sliding window layer attending in full moves the logits far
    beyond the tolerance."""
    model = load_pretrained(str(checkpoints["llama3_tied"]))
    hf_logits, _ = hf_logits_and_grads("llama3_tied")
    tokens = case_tokens()[:, :-1]
    with torch.no_grad():
        model.config = replace(model.config, rope_scaling=RopeScaling())
        assert (model(tokens) - hf_logits).abs().max() > 1e-2
        model = load_pretrained(str(checkpoints["llama3_tied"]))
        head_dim = model.config.head_dim
        for block in model.layers:
            for proj in (block.attention.wq, block.attention.wk):
                heads = proj.weight.shape[0] // head_dim
                interleaved = proj.weight.view(heads, 2, head_dim // 2, -1).transpose(1, 2)
                proj.weight.copy_(interleaved.reshape(proj.weight.shape))
        assert (model(tokens) - hf_logits).abs().max() > 1e-2
    # The sliding window matters: the same Qwen2 weights with full attention on layer 1.
    hf_logits, _ = hf_logits_and_grads("qwen2_sliding")
    model = load_pretrained(str(checkpoints["qwen2_sliding"]))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_logits, **F32_TOL)
        model.layers[1].attention.window = None
        assert (model(tokens) - hf_logits).abs().max() > 1e-2
    hf_logits, _ = hf_logits_and_grads("mistral_sliding")  # Mistral: every layer's window
    model = load_pretrained(str(checkpoints["mistral_sliding"]))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_logits, **F32_TOL)
        for block in model.layers:
            block.attention.window = None
        assert (model(tokens) - hf_logits).abs().max() > 1e-2


def test_features_become_config_fields(checkpoints: dict) -> None:
    """config.json's features are ModelConfig fields, and both RoPE spellings read alike."""
    llama3 = read_model_config(str(checkpoints["llama3_tied"]))
    assert llama3.tie_embeddings and llama3.rope_theta == 500_000.0
    assert llama3.rope_scaling == RopeScaling(kind="llama3", factor=8.0,
                                              original_max_position_embeddings=16)
    new_spelling = json.loads((checkpoints["llama3_tied"] / "config.json").read_text())
    new_spelling["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0,
                                       "original_max_position_embeddings": 16,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "rope_theta": new_spelling.pop("rope_theta")}
    del new_spelling["rope_scaling"]
    assert config_from_hf(new_spelling) == llama3
    linear = read_model_config(str(checkpoints["llama_linear_biases"]))
    assert linear.qkv_bias and linear.o_bias and linear.mlp_bias and not linear.qk_norm
    qwen2 = read_model_config(str(checkpoints["qwen2_biases"]))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.rope_theta == 1_000_000.0
    qwen3 = read_model_config(str(checkpoints["qwen3_qk_norm"]))
    assert qwen3.qk_norm and qwen3.explicit_head_dim == 16 and qwen3.head_dim == 16
    sliding = read_model_config(str(checkpoints["qwen2_sliding"]))
    assert (sliding.sliding_window, sliding.sliding_layers) == (5, (1,))
    assert [sliding.layer_window(i) for i in range(2)] == [None, 5]
    mistral = read_model_config(str(checkpoints["mistral_sliding"]))
    assert (mistral.sliding_window, mistral.sliding_layers) == (5, None)
    assert not (mistral.qkv_bias or mistral.o_bias or mistral.mlp_bias or mistral.qk_norm)
    no_window = {**json.loads((checkpoints["mistral_sliding"] / "config.json").read_text()),
                 "sliding_window": None}
    assert config_from_hf(no_window).sliding_window is None
    yarn = read_model_config(str(checkpoints["llama_yarn"])).rope_scaling
    assert (yarn.kind, yarn.factor, yarn.beta_fast, yarn.beta_slow) == ("yarn", 4.0, 32.0, 1.0)


# ------------------------------------------------------------------------------ round trips


def assert_same_hf_model(path: Path, case: str, reference_logits: torch.Tensor) -> None:
    """transformers loads ``path`` as ``case``'s architecture with the original's tensors,
    bit for bit, and the same logits."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    original = hf_model(case)
    assert type(loaded).__name__ == type(original).__name__
    theirs = original.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    logits = loaded(input_ids=case_tokens()[:, :-1]).logits
    torch.testing.assert_close(logits, reference_logits, **F32_TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_through_ringray(case: str, checkpoints: dict, tmp_path: Path) -> None:
    """transformers -> load_pretrained -> save_pretrained -> transformers: same architecture,
    same tensors, logits equal to ringray's and the original's; the tokenizer is copied
    along; load_pretrained reads the saved checkpoint back to the same config."""
    model = load_pretrained(str(checkpoints[case]))
    ours = model(case_tokens()[:, :-1]).detach()
    save_pretrained(model, str(tmp_path / "out"))
    assert_same_hf_model(tmp_path / "out", case, ours)
    torch.testing.assert_close(ours, hf_logits_and_grads(case)[0], **F32_TOL)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (checkpoints[case] / name).read_bytes()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [type(hf_model(case)).__name__]
    assert "rope_parameters" in written and "rope_theta" in written
    assert read_model_config(str(tmp_path / "out")) == model.config


def test_sharded_round_trip(checkpoints: dict, tmp_path: Path) -> None:
    """Above ``max_shard_bytes`` the weights go into several shards and an index; no shard
    holding more than one tensor exceeds the limit; transformers and load_pretrained read
    them back; a row range of one tensor reads alone."""
    model = load_pretrained(str(checkpoints["qwen3_qk_norm"]))
    ours = model(case_tokens()[:, :-1]).detach()
    limit = 16_384
    save_pretrained(model, str(tmp_path / "sharded"), max_shard_bytes=limit)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (tmp_path / "sharded" / "model.safetensors").exists()
    for shard in shards:
        tensors = load_file(tmp_path / "sharded" / shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1
    assert_same_hf_model(tmp_path / "sharded", "qwen3_qk_norm", ours)
    again = load_pretrained(str(tmp_path / "sharded"))
    torch.testing.assert_close(again(case_tokens()[:, :-1]), ours, atol=0, rtol=0)
    checkpoint = SafetensorsCheckpoint(str(tmp_path / "sharded"))
    table = model.tok_embeddings.weight.detach()
    torch.testing.assert_close(
        checkpoint.read("model.embed_tokens.weight", rows=slice(5, 9)), table[5:9], atol=0, rtol=0
    )


def test_fsspec_url_round_trip(checkpoints: dict, tmp_path: Path) -> None:
    """A checkpoint on an fsspec filesystem (memory://) loads through ranged reads, sharded
    or not, rows included, and save_pretrained writes there too."""
    fs = fsspec.filesystem("memory")
    local = checkpoints["llama_yarn"]
    save_pretrained(load_pretrained(str(local)), str(tmp_path / "sharded"),
                    max_shard_bytes=20_000)
    for name, directory in (("single", local), ("sharded", tmp_path / "sharded")):
        for file in directory.iterdir():
            fs.pipe(f"/ckpt-{name}/{file.name}", file.read_bytes())
    reference = load_pretrained(str(local))
    tokens = case_tokens()[:, :-1]
    want = reference(tokens)
    for name in ("single", "sharded"):
        remote = load_pretrained(f"memory://ckpt-{name}")
        torch.testing.assert_close(remote(tokens), want, atol=0, rtol=0)
        rows = SafetensorsCheckpoint(f"memory://ckpt-{name}").read(
            "model.layers.1.mlp.down_proj.weight", rows=slice(3, 11))
        torch.testing.assert_close(
            rows, reference.layers[1].feed_forward.w2.weight.detach()[3:11], atol=0, rtol=0)
    save_pretrained(reference, "memory://written")
    assert fs.exists("/written/tokenizer.json")
    torch.testing.assert_close(load_pretrained("memory://written")(tokens), want, atol=0, rtol=0)
    fs.rm("/", recursive=True)


def test_save_keeps_source_keys_and_applies_overrides(checkpoints: dict, tmp_path: Path) -> None:
    """Keys ringray does not model (token ids, context length) survive a save; overrides and
    a cast to bfloat16 for release are applied."""
    model = load_pretrained(str(checkpoints["llama3_tied"]))
    save_pretrained(model, str(tmp_path / "out"), dtype=torch.bfloat16,
                    config_overrides={"max_position_embeddings": 1024})
    source = json.loads((checkpoints["llama3_tied"] / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["eos_token_id"] == source["eos_token_id"]
    assert written["max_position_embeddings"] == 1024 and written["dtype"] == "bfloat16"
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")
    assert load_pretrained(str(tmp_path / "out")).norm.weight.dtype == torch.float32


def test_preset_model_saves_as_llama(tmp_path: Path) -> None:
    """A model trained from a preset (no source checkpoint) saves as a LlamaForCausalLM that
    transformers runs to the same logits."""
    from transformers import AutoModelForCausalLM

    from ringray.model import model_preset

    torch.manual_seed(0)
    model = Transformer(model_preset("debug", vocab_size=96))
    save_pretrained(model, str(tmp_path / "preset"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "preset", attn_implementation="sdpa")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    tokens = case_tokens()[:, :-1]
    torch.testing.assert_close(loaded(input_ids=tokens).logits, model(tokens), **F32_TOL)


def test_save_from_a_state_dict(checkpoints: dict, tmp_path: Path) -> None:
    """``save_hf_checkpoint`` writes from a state dict by our names (as an FSDP job gathers
    it; a tied model's ``output.weight`` entry is ignored) the same files save_pretrained
    writes; a state dict missing a parameter is refused in one line."""
    from ringray.model import save_hf_checkpoint

    source = str(checkpoints["llama3_tied"])
    model = load_pretrained(source)
    state = model.state_dict()
    assert "output.weight" in state
    save_hf_checkpoint(state, model.config, str(tmp_path / "a"), source=source)
    save_pretrained(model, str(tmp_path / "b"))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    del state["norm.weight"]
    with pytest.raises(ValueError, match=r"^state_dict: norm.weight is missing \(1 in all\)$"):
        save_hf_checkpoint(state, model.config, str(tmp_path / "c"))


# ------------------------------------------------------------------------------ refusals


def broken_copy(source: Path, tmp_path: Path, *, drop: str | None = None,
                replace_tensor: tuple[str, torch.Tensor] | None = None,
                config: dict | None = None) -> str:
    """A copy of ``source`` with a tensor dropped or replaced, or config.json keys changed."""
    target = tmp_path / "broken"
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    if drop:
        del tensors[drop]
    if replace_tensor:
        tensors[replace_tensor[0]] = replace_tensor[1]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    if config:
        data = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**data, **config}))
    return str(target)


BROKEN = {
    "missing tensor": (
        dict(drop="model.layers.1.mlp.up_proj.weight"),
        r"^model\.layers\.1\.mlp\.up_proj\.weight: missing from the checkpoint at .*broken$"),
    "tensor shape": (
        dict(replace_tensor=("model.layers.0.self_attn.k_proj.weight", torch.zeros(24, 32))),
        r"^model\.layers\.0\.self_attn\.k_proj\.weight: shape \[24, 32\] in the checkpoint, "
        r"expected \[16, 32\] from its config.json$"),
    "config shape": (
        dict(config={"intermediate_size": 48}),
        r"^model\.layers\.0\.mlp\.gate_proj\.weight: shape \[64, 32\] in the checkpoint, "
        r"expected \[48, 32\]"),
    "unexpected tensor": (
        dict(replace_tensor=("model.layers.0.self_attn.q_proj.bias", torch.zeros(32))),
        r"^model\.layers\.0\.self_attn\.q_proj\.bias: unexpected tensor"),
    "architecture": (
        dict(config={"architectures": ["GPT2LMHeadModel"]}),
        r"^architectures: \['GPT2LMHeadModel'\] is not supported; supported: "
        r"LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM "
        r"\(in .*config.json\)$"),
    "rope type": (
        dict(config={"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
        r"^rope_type: 'dynamic' is not supported; supported: default, linear, llama3, yarn"),
    "sliding window on llama": (
        dict(config={"use_sliding_window": True, "sliding_window": 4}),
        r"^use_sliding_window: LlamaForCausalLM has no sliding window"),
    "layer type": (
        dict(config={"layer_types": ["full_attention", "chunked_attention"]}),
        r"^layer_types: \['chunked_attention'\] is not supported; expected full_attention or "
        r"sliding_attention"),
    "window size": (
        dict(config={"layer_types": ["full_attention", "sliding_attention"],
                     "sliding_window": None}),
        r"^sliding_window: None with sliding-attention layers \[1\]; expected a positive whole "
        r"number of keys"),
}
QWEN_CASES = ("layer type", "window size")  # checked on a Qwen3 checkpoint, the rest on Llama


@pytest.mark.parametrize("what", list(BROKEN))
def test_broken_checkpoint_is_refused_in_one_line(what: str, checkpoints: dict,
                                                  tmp_path: Path) -> None:
    """Each defect raises a ValueError whose single line names the tensor or key and, for a
    shape, the expected and found values."""
    change, pattern = BROKEN[what]
    source = checkpoints["qwen3_qk_norm" if what in QWEN_CASES else "llama_yarn"]
    path = broken_copy(source, tmp_path, **change)
    with pytest.raises(ValueError, match=pattern) as info:
        load_pretrained(path)
    assert "\n" not in str(info.value)
    assert set(ARCHITECTURES) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "MistralForCausalLM"}


# ------------------------------------------------------------------------------ job spec


def test_model_options_from_pretrained(checkpoints: dict) -> None:
    """``model.from_pretrained`` builds the checkpoint's config, RoPE overrides apply on top
    (context extension), and shape fields beside it are refused in one line."""
    from ringray.model import ModelOptions, RopeOptions
    from ringray.spec import parse_job_spec

    path = str(checkpoints["llama3_tied"])
    assert ModelOptions(from_pretrained=path).build() == read_model_config(path)
    extended = ModelOptions(from_pretrained=path, rope=RopeOptions(factor=16.0)).build()
    assert extended.rope_scaling == replace(read_model_config(path).rope_scaling, factor=16.0)
    spec = parse_job_spec({"model": {"from_pretrained": path,
                                     "rope": {"scaling": "yarn", "factor": 4.0}}})
    assert spec.train_options().model.rope_scaling == RopeScaling(
        kind="yarn", factor=4.0, original_max_position_embeddings=16)
    for shape in ({"n_layers": 4}, {"preset": "small"}):
        with pytest.raises(ValueError, match=r"^from_pretrained: the checkpoint's config.json "
                                             r"gives the shape; remove") as info:
            ModelOptions(from_pretrained=path, **shape)
        assert "\n" not in str(info.value)
