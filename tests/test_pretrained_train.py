"""A pretrained Hugging Face model through the whole job: ``model.from_pretrained`` in a job
spec trains from its weights with its tokenizer, ``ringray export`` writes the result back as a
Hugging Face checkpoint that transformers loads with the same logits, and a broken checkpoint
is refused in one line before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
import yaml
from hf_cases import write_tokenizer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ringray.cli import app
from ringray.model import Transformer
from ringray.spec import load_job_spec
from ringray.train import CheckpointStore

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
VOCAB = 320  # room for the tiny tokenizer's 261 tokens


def _pretrained(directory: Path) -> Path:
    """A tiny Llama (tied embeddings) with random weights and a tokenizer, saved by
    transformers as a published checkpoint is."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, rope_theta=10_000.0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def _spec(tmp_path: Path, pretrained: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    (corpus / "a.txt").write_text("The pass key is 12345. Remember it. " * 40)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    spec = {
        "name": "pretrained", "run_dir": str(run_dir),
        "model": {"from_pretrained": str(pretrained)},
        "data": {"source": "files", "path": str(corpus)},
        "parallel": {"dp": 1, "cp": 1, "attention_backend": "sdpa"},
        "train": {"steps": 3, "global_batch": 2, "seq_len": 64, "precision": "fp32",
                  "peak_tflops_per_device": 1.0, "optimizer": {"lr": 1e-2, "warmup_steps": 1}},
        "eval": {"passkey_lengths": []},
    }
    path = run_dir / "job.yaml"  # where `ringray train` keeps the spec as run
    path.write_text(yaml.safe_dump(spec))
    return path


def _logits_hf(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def test_train_from_pretrained_then_export_loads_in_transformers(tmp_path: Path) -> None:
    """HF checkpoint -> 3 training steps (its weights, its tokenizer) -> `ringray export` ->
    transformers loads the export, and its logits equal ringray's trained model's (1e-5)."""
    source = _pretrained(tmp_path / "source")
    spec_path = _spec(tmp_path, source)
    trained = subprocess.run([str(BIN / "python"), "-m", "ringray.train", "--config",
                              str(spec_path)], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    steps = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in steps] == [1, 2, 3]

    # The run keeps the source's config.json and tokenizer: it exports once the source is
    # gone (issue 40: the run could never be exported again).
    assert {p.name for p in (tmp_path / "run" / "pretrained").iterdir()} >= {
        "config.json", "tokenizer.json", "tokenizer_config.json"}
    source = source.rename(tmp_path / "moved-away")
    out = tmp_path / "exported"
    exported = subprocess.run([str(BIN / "ringray"), "export", str(tmp_path / "run"),
                               "--hf", str(out)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "exported step 3" in exported.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert config["max_position_embeddings"] == 256  # the source's, longer than seq_len

    options = load_job_spec(spec_path, [f"model.from_pretrained={source}"],
                            check_paths=False).train_options()
    model = Transformer(options.model)
    store = CheckpointStore(options.checkpoint_location)
    store.load(store.latest(), {"model": model.state_dict()})
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    theirs = _logits_hf(out, tokens)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    before = _logits_hf(source, tokens)
    assert (before - theirs).abs().max() > 1e-3, "training changed the weights"


def test_export_names_the_steps_there_are(tmp_path: Path) -> None:
    source = _pretrained(tmp_path / "source")
    spec_path = _spec(tmp_path, source)
    options = load_job_spec(spec_path, check_paths=False).train_options()
    CheckpointStore(options.checkpoint_location, lineage="x").save(
        2, {"model": Transformer(options.model).state_dict()}, keep=3)
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--hf",
                                      str(tmp_path / "out"), "--step", "7"])
    assert result.exit_code == 2
    assert "--step: 7 is not a committed checkpoint" in result.stderr
    assert "its steps: [2]" in result.stderr


# ------------------------------------------------------------------ refused before anything runs
def _drop_tensor(directory: Path, name: str) -> None:
    tensors = load_file(directory / "model.safetensors")
    del tensors[name]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


BROKEN = {
    "missing tensor": (
        lambda d: _drop_tensor(d, "model.layers.1.mlp.up_proj.weight"),
        "model.layers.1.mlp.up_proj.weight: missing from the checkpoint"),
    "shape mismatch": (
        lambda d: _edit_config(d, intermediate_size=48),
        "shape [64, 32] in the checkpoint, expected [48, 32] from its config.json"),
    "unsupported architecture": (
        lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]),
        "['GPT2LMHeadModel'] is not supported; supported: LlamaForCausalLM"),
    "tokenizer without EOS": (
        lambda d: (write_tokenizer(d, with_eos=False), _edit_config(d, eos_token_id=None)),
        "end-of-sequence"),
}


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting Ray fails the test: a broken checkpoint must be reported before it."""

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called for a broken checkpoint")

    monkeypatch.setattr(ray, "init", tripwire)


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_pretrained_checkpoint_is_one_line_and_starts_nothing(
    tmp_path: Path, case: str, no_ray: None,
) -> None:
    source = _pretrained(tmp_path / "source")
    breaks, message = BROKEN[case]
    breaks(source)
    spec_path = _spec(tmp_path, source)
    result = CliRunner().invoke(app, ["train", str(spec_path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    assert message in lines[0]
    assert not (tmp_path / "run" / "steps.jsonl").exists()


def test_an_exported_preset_model_can_be_trained_from_again(tmp_path: Path) -> None:
    """A preset (byte tokenizer) trained and exported: the export holds a tokenizer.json
    that encodes to the same ids, so a job can start from it with model.from_pretrained (the
    context-extension recipe: train short, export, extend)."""
    from ringray.data import ByteTokenizer, HFTokenizer
    from ringray.model import load_pretrained

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = {"name": "preset", "run_dir": str(run_dir),
            "model": {"preset": "debug", "dim": 64, "n_layers": 2, "ffn_hidden": 128},
            "data": {"source": "passkey"}, "parallel": {"dp": 1, "cp": 1},
            "train": {"steps": 2, "global_batch": 2, "seq_len": 256, "precision": "fp32",
                      "peak_tflops_per_device": 1.0},
            "eval": {"passkey_lengths": []}}
    (run_dir / "job.yaml").write_text(yaml.safe_dump(spec))
    trained = subprocess.run([str(BIN / "python"), "-m", "ringray.train", "--config",
                              str(run_dir / "job.yaml")], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export", str(run_dir), "--hf", str(out)])
    assert result.exit_code == 0, result.output

    text = "The pass key is 48213. Remember it, héhé."
    assert HFTokenizer.from_pretrained(out).encode(text) == ByteTokenizer().encode(text)
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == ByteTokenizer().eos_id
    extend = {**spec, "name": "extend", "run_dir": str(tmp_path / "extend"),
              "model": {"from_pretrained": str(out), "rope": {"theta": 160_000.0}}}
    (tmp_path / "extend.yaml").write_text(yaml.safe_dump(extend))
    options = load_job_spec(tmp_path / "extend.yaml").train_options()  # checks the export
    assert options.model.rope_theta == 160_000.0 and options.pretrained == str(out)
    model = load_pretrained(out)
    reference = Transformer(load_job_spec(run_dir / "job.yaml",
                                          check_paths=False).train_options().model)
    store = CheckpointStore(str(run_dir / "checkpoints"))
    store.load(store.latest(), {"model": reference.state_dict()})
    tokens = torch.randint(0, 259, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), atol=1e-6, rtol=1e-6)
