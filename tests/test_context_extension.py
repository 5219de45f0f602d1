"""The context-extension demonstration's parts, fast (the demonstration itself is
``make extend-demo``, about twenty minutes, and not part of the suite):

- the ``passkey_retrieval`` source: the loss counts exactly the key's repeat in the needle and
  the answer, for bytes and for a BPE with multi-digit tokens, through the packed loader at
  any DP degree;
- the three job files validate and chain: each later stage starts from the export of the
  one before, over a ring, at a longer length with a raised RoPE base, scored on the same
  depths, the last at 8192 tokens or more;
- the "before" evaluation of ``examples/context_extension.py`` scores an export with both
  RoPEs, and ``ringray report`` plots it beside the run's own ``passkey.json``.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch
import yaml
from hf_cases import write_tokenizer

from ringray.data import (
    IGNORE_LABEL,
    ByteTokenizer,
    HFTokenizer,
    PackedLoader,
    PasskeySource,
    make_passkey_sample,
    make_source,
)
from ringray.data.passkey import passkey_retrieval_mask
from ringray.model import Transformer, model_preset, save_pretrained
from ringray.plots import PASSKEY_AFTER_LABEL, ReportError, read_passkey_reports, write_report
from ringray.spec import load_job_spec

ROOT = Path(__file__).resolve().parents[1]
STAGE_JOBS = [ROOT / f"jobs/{name}.yaml"
              for name in ("extend-1-short", "extend-2-mid", "extend-3-long")]


# --- the passkey_retrieval source -----------------------------------------------------------

def _counted_text(tokenizer, sample) -> list[str]:
    """The decoded runs of counted tokens, in order."""
    mask = passkey_retrieval_mask(tokenizer, sample)
    tokens = sample.tokens.tolist()
    runs, current = [], []
    for token, counted in zip(tokens, mask, strict=True):
        if counted:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_retrieval_mask_counts_the_keys_repeat_and_the_answer_bytes(depth):
    """Bytes: ten counted tokens, the repeat's five digits inside the needle and the five of
    the answer at the end; never the first (random) copy."""
    tok = ByteTokenizer()
    sample = make_passkey_sample(tok, seq_len=700, depth=depth, passkey="40213")
    mask = passkey_retrieval_mask(tok, sample)
    assert len(mask) == 700 and sum(mask) == 10
    assert _counted_text(tok, sample) == ["40213", "40213"]
    assert all(mask[sample.answer_start:])
    text = tok.decode(sample.tokens.tolist())
    first_copy = text.index("40213")
    assert not any(mask[first_copy : first_copy + 5])


def test_retrieval_mask_with_multi_digit_tokens(tmp_path):
    """A BPE that merges digits (``345``, ``12``): the counted tokens still decode to the
    key twice, whatever the merges."""
    write_tokenizer(tmp_path / "ckpt")
    tok = HFTokenizer.from_pretrained(str(tmp_path / "ckpt"))
    for key in ("34512", "12345", "90817"):
        sample = make_passkey_sample(tok, seq_len=400, depth=0.5, passkey=key)
        runs = _counted_text(tok, sample)
        assert [run.strip() for run in runs] == [key, key], (key, runs)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_loader_labels_only_the_retrieval_tokens(dp_size):
    """Through the packed loader: every label but the counted ones is IGNORE_LABEL, the
    counted labels are the next tokens, and DP slices carry the same labels as one rank."""
    tok, seq_len = ByteTokenizer(), 384
    source = make_source("passkey_retrieval", seq_len=seq_len, seed=3)
    plain = make_source("passkey", seq_len=seq_len, seed=3)
    assert isinstance(source, PasskeySource) and source.loss == "retrieval"
    assert plain.loss_mask is None and "retrieval" in source.describe()
    loaders = [PackedLoader(source, tokenizer=tok, seq_len=seq_len, global_batch=4,
                            dp_rank=rank, dp_size=dp_size, seed=0) for rank in range(dp_size)]
    full = PackedLoader(plain, tokenizer=tok, seq_len=seq_len, global_batch=4, dp_rank=0,
                        dp_size=1, seed=0)
    for index in (0, 5):
        inputs = torch.cat([loader.batch(index)[0] for loader in loaders])
        labels = torch.cat([loader.batch(index)[1] for loader in loaders])
        want_inputs, want_labels = full.batch(index)
        torch.testing.assert_close(inputs, want_inputs, rtol=0, atol=0)
        counted = labels != IGNORE_LABEL
        assert counted.sum(dim=1).tolist() == [10] * 4  # one sample per sequence
        torch.testing.assert_close(labels[counted], want_labels[counted], rtol=0, atol=0)
        for row in range(4):
            text = tok.decode(labels[row][counted[row]].tolist())
            assert text[:5] == text[5:] and text.isdigit()
        # The loss's denominator, the same on every rank: the global batch's counted labels,
        # with packed documents also leaving out each document's last label.
        packed = [loader.packed(index) for loader in loaders]
        in_documents = sum(int((p.labels != IGNORE_LABEL).sum()) for p in packed)
        for loader, batch in zip(loaders, packed, strict=True):
            assert loader.counted_labels(index, documents=False) == int(counted.sum()) == 40
            assert loader.counted_labels(index, documents=True) == in_documents
            assert batch.counted_labels == in_documents


def test_loss_mask_length_mismatch_is_refused():
    class Broken(PasskeySource):
        def loss_mask(self, index, tokenizer):
            return [True] * 3

    loader = PackedLoader(Broken(300, 0, loss="retrieval"), tokenizer=ByteTokenizer(),
                          seq_len=300, global_batch=1, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="loss mask of document .* has 3 entries"):
        loader.batch(0)


def test_passkey_source_rejects_an_unknown_loss():
    with pytest.raises(ValueError, match="loss: 'some' is not 'all' or 'retrieval'"):
        PasskeySource(300, 0, loss="some")


# --- the job files ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """A stand-in for stage 1's export: an untrained debug model written as `ringray export`
    writes a preset's (the byte tokenizer as tokenizer.json)."""
    path = tmp_path_factory.mktemp("export") / "hf"
    torch.manual_seed(0)
    tok = ByteTokenizer()
    save_pretrained(Transformer(model_preset("debug")), str(path), config_overrides={
        "max_position_embeddings": 512, "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})
    tok.save_hf(str(path))
    return path


def test_the_demo_jobs_validate_and_chain(export_dir, tmp_path):
    """Stage 1: the debug model at a short length on passkey_retrieval. Each later stage:
    from the previous stage's export (the path in the file), over a ring, at a longer length
    with a raised RoPE base, the same data kind and model, scored at its own length on the
    same depths; the last stage at 8192 tokens or more."""
    short = load_job_spec(STAGE_JOBS[0], [f"run_dir={tmp_path / 'short'}"]).train_options()
    assert short.data.source == "passkey_retrieval"
    assert list(short.eval.passkey_lengths) == [short.train.seq_len]
    previous, previous_job = short, STAGE_JOBS[0]
    for number, job in enumerate(STAGE_JOBS[1:], start=2):
        raw = yaml.safe_load(job.read_text())
        previous_run = load_job_spec(previous_job, [f"model.from_pretrained={export_dir}"],
                                     check_paths=False).train_options().run_dir
        assert raw["model"]["from_pretrained"] == f"{previous_run}/hf", job.name
        stage = load_job_spec(job, [f"model.from_pretrained={export_dir}",
                                    f"run_dir={tmp_path / str(number)}"]).train_options()
        assert stage.parallel.cp >= 2
        assert stage.train.seq_len > previous.train.seq_len
        assert stage.model.rope_theta > previous.model.rope_theta
        assert stage.data.source == short.data.source
        assert list(stage.eval.passkey_lengths) == [stage.train.seq_len]
        assert stage.eval.passkey_depths == short.eval.passkey_depths
        assert (stage.model.dim, stage.model.n_layers) == (short.model.dim, short.model.n_layers)
        previous, previous_job = stage, job
    assert previous.train.seq_len >= 8192 and previous.train.seq_len >= 16 * short.train.seq_len


# --- the "before" evaluation and the report --------------------------------------------------

def _example_module():
    spec = importlib.util.spec_from_file_location(
        "context_extension", ROOT / "examples/context_extension.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_before_evaluation_and_report(export_dir, tmp_path):
    """The example's before-evaluation scores the export with its own and the job's RoPE
    (short lengths here, for speed), labelled; `ringray report` draws them with the run's
    passkey.json in passkey.png."""
    job = tmp_path / "long.yaml"
    job.write_text(STAGE_JOBS[1].read_text())
    overrides = [f"model.from_pretrained={export_dir}", "eval.passkey_lengths=[256]",
                 "eval.passkey_samples=2", "model.rope.theta=160000"]
    spec = load_job_spec(job, overrides)
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    run = tmp_path / "run"
    results = _example_module().evaluate_before(job, export_dir, run)
    assert sorted(results) == ["before-1-trained-rope", "before-2-extended-rope"]
    assert "theta 10000" in results["before-1-trained-rope"]["label"]
    assert "theta 160000" in results["before-2-extended-rope"]["label"]
    for name, result in results.items():
        written = json.loads((run / f"passkey-{name}.json").read_text())
        assert written == result and written["lengths"] == [256]
        assert len(written["cells"]) == len(spec.eval.passkey_depths)

    (run / "passkey.json").write_text(json.dumps(
        {**results["before-1-trained-rope"], "label": None}))
    labels = [label for label, _ in read_passkey_reports(run)]
    assert labels == [results["before-1-trained-rope"]["label"],
                      results["before-2-extended-rope"]["label"], PASSKEY_AFTER_LABEL]
    steps = {"step": 1, "loss": 2.0, "tokens_per_second": 1.0, "overlap_ratio": 1.0,
             "load_imbalance": 1.0}
    (run / "steps.jsonl").write_text(json.dumps(steps) + "\n")
    paths = write_report(run)
    assert paths[-1] == run / "report" / "passkey.png"
    data = paths[-1].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 300 and len(data) > 10_000


def test_report_without_passkey_files_has_no_passkey_plot_and_bad_ones_are_one_line(tmp_path):
    steps = {"step": 1, "loss": 2.0, "tokens_per_second": 1.0, "overlap_ratio": 1.0,
             "load_imbalance": 1.0}
    (tmp_path / "steps.jsonl").write_text(json.dumps(steps) + "\n")
    assert all(p.name != "passkey.png" for p in write_report(tmp_path))
    (tmp_path / "passkey-before.json").write_text('{"cells": [{"length": 8}]}')
    with pytest.raises(ReportError, match="passkey-before.json: not a passkey report") as info:
        write_report(tmp_path)
    assert "\n" not in str(info.value)
    (tmp_path / "passkey-before.json").write_text("{")
    with pytest.raises(ReportError, match="passkey-before.json: not JSON"):
        read_passkey_reports(tmp_path)
