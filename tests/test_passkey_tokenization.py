"""Passkey samples are the prompt's text tokenized as a whole, and a tokenizer that writes pass
keys in a way the passkey task cannot read is refused before training (issue 24).

- With the real SmolLM2-135M tokenizer (BPE): a sample of N tokens is exactly N tokens, those
  tokens are what the tokenizer makes of the sample's own decoded text (before the fix an
  8192-token sample re-tokenized to 6785: each filler sentence was tokenized alone, so a
  BPE wrote ``.`` ``␠`` ``The`` where running text has ``.`` ``␠The``), the needle sits at the
  sentence boundary nearest the requested depth, and the answer is the key's digit tokens.
  A 32768-token sample takes well under a second to build (no re-tokenization per sentence).
- The byte tokenizer (the presets') and the tiny multi-digit BPE of ``hf_cases`` still work.
- :func:`check_passkey_tokenizer` accepts those three and refuses a tokenizer whose digits do
  not come back (unknown to its vocabulary) or that glues the key's first digit to the word
  before it; a job with such a ``model.from_pretrained`` and ``eval.passkey_lengths`` is
  refused in one line by the job spec's up-front check, and ``ringray train`` exits 2 on it
  before Ray starts, writing nothing.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import ray
import yaml
from hf_cases import write_tokenizer
from typer.testing import CliRunner

from ringray.cli import app
from ringray.data import ByteTokenizer, HFTokenizer, make_passkey_sample, passkey_min_seq_len
from ringray.data.passkey import (
    _prompt_lengths,
    check_passkey_tokenizer,
    passkey_retrieval_mask,
)
from ringray.model import ModelConfig, Transformer, save_pretrained
from ringray.model.gguf_import import cached_model
from ringray.spec import JobSpecError, load_job_spec

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is {key}"


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    """The real SmolLM2-135M tokenizer (the checkpoint tests/test_real_model.py uses)."""
    return HFTokenizer.from_pretrained(str(cached_model("smollm2-135m")))


@pytest.fixture
def tiny(tmp_path: Path) -> HFTokenizer:
    write_tokenizer(tmp_path / "tiny")
    return HFTokenizer.from_pretrained(str(tmp_path / "tiny"))


def assert_sample_is_running_text(tokenizer, sample, seq_len: int, depth: float) -> None:
    """Exactly ``seq_len`` tokens that round-trip, one needle, the question at the end, the
    needle at the boundary nearest ``depth`` (within a sentence's tokens), the answer the key."""
    key = sample.passkey
    tokens = sample.tokens.tolist()
    assert len(tokens) == seq_len
    text = tokenizer.decode(tokens)
    assert tokenizer.encode(text) == tokens
    assert text.endswith(QUESTION.format(key=key))
    assert text.count(NEEDLE.format(key=key)) == 1
    assert tokenizer.decode(tokens[sample.needle_start:]).lstrip().startswith(
        NEEDLE.format(key=key))
    assert NEEDLE.format(key=key) not in tokenizer.decode(tokens[sample.needle_start + 1:])
    assert tokenizer.decode(tokens[sample.answer_start:]) == key
    needle, question = _prompt_lengths(tokenizer, key)
    filler = seq_len - needle - question
    assert abs(sample.needle_start - depth * filler) <= 8, (sample.needle_start, depth * filler)


@pytest.mark.parametrize("seq_len", [2048, 8192])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_a_smollm2_sample_is_its_own_text_tokenized_whole(smollm2, seq_len, depth) -> None:
    sample = make_passkey_sample(smollm2, seq_len=seq_len, depth=depth, passkey="48213")
    assert_sample_is_running_text(smollm2, sample, seq_len, depth)
    # SmolLM2 writes one token per digit: the answer is the key's five digit tokens.
    answer = sample.tokens[sample.answer_start:].tolist()
    assert [smollm2.decode([t]) for t in answer] == list("48213")
    if depth == 1.0:  # right before the question: its last filler sentence ends it
        text = smollm2.decode(sample.tokens)
        assert text.endswith("There and back again. " + NEEDLE.format(key="48213") + " "
                             + QUESTION.format(key="48213"))


def test_smollm2_samples_round_trip_for_many_lengths_and_keys(smollm2) -> None:
    """Every length from the minimum up, at depth 0 (the needle first, the filler cut right
    after it, where a cut before ``.`` would not round-trip and the next boundary is taken)
    and at random depths."""
    minimum = passkey_min_seq_len(smollm2, 5)
    for i, seq_len in enumerate(range(minimum, minimum + 40)):
        key = f"{(i * 7919) % 100000:05d}"
        for depth in (0.0, (i * 0.137) % 1.0):
            sample = make_passkey_sample(smollm2, seq_len=seq_len, depth=depth, passkey=key)
            assert_sample_is_running_text(smollm2, sample, seq_len, depth)


def test_a_32k_smollm2_sample_is_quick_and_round_trips(smollm2) -> None:
    started = time.perf_counter()
    sample = make_passkey_sample(smollm2, seq_len=32768, depth=0.5, passkey="90817")
    seconds = time.perf_counter() - started
    assert_sample_is_running_text(smollm2, sample, 32768, 0.5)
    assert seconds < 5.0, seconds  # ~0.3 s here; tokenizing sentence by sentence is minutes


def test_retrieval_mask_on_smollm2_counts_the_repeat_and_the_answer(smollm2) -> None:
    sample = make_passkey_sample(smollm2, seq_len=1024, depth=0.4, passkey="40213")
    mask = passkey_retrieval_mask(smollm2, sample)
    tokens = sample.tokens.tolist()
    counted = [smollm2.decode([t]) for t, m in zip(tokens, mask, strict=True) if m]
    assert counted == list("40213") * 2
    assert all(mask[sample.answer_start:])


@pytest.mark.parametrize("seq_len", [166, 1000, 32768])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_byte_samples_keep_their_layout(seq_len, depth) -> None:
    """Bytes: the needle first at depth 0, right before the question at 1, the key's five
    bytes last; the text is the sample's bytes."""
    tok = ByteTokenizer()
    sample = make_passkey_sample(tok, seq_len=seq_len, depth=depth, passkey="48213")
    assert_sample_is_running_text(tok, sample, seq_len, depth)
    assert sample.answer_start == seq_len - 5
    needle = NEEDLE.format(key="48213") + " "
    if depth == 0.0:
        assert sample.needle_start == 0
    if depth == 1.0:
        assert sample.needle_start + len(needle) == seq_len - len(QUESTION.format(key="48213"))


def test_multi_digit_bpe_samples_round_trip(tiny) -> None:
    for depth in (0.0, 0.5, 1.0):
        sample = make_passkey_sample(tiny, seq_len=500, depth=depth, passkey="12345")
        assert_sample_is_running_text(tiny, sample, 500, depth)
        answer = sample.tokens[sample.answer_start:].tolist()
        assert [tiny.decode([t]) for t in answer] == ["12", "345"]


# ------------------------------------------------------------------- tokenizers refused


def glued_tokenizer():
    """A byte-level BPE over the whole text (no regex split) whose merges join ``s␠`` and a
    digit: ``is 40213`` becomes ``i`` ``s␠4`` ``0`` ``2`` ``1`` ``3``, so the answer's first
    token holds the word's last letter."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("s", "Ġ")] + [("sĠ", d) for d in "0123456789"]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|end_of_text|>"])
    return tokenizer


def digitless_tokenizer():
    """A byte-level BPE whose vocabulary lacks the ten digits: they become ``<unk>``, which
    decodes to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = [s for s in sorted(pre_tokenizers.ByteLevel.alphabet()) if not s.isdigit()]
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab["<unk>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|end_of_text|>", "<unk>"])
    return tokenizer


BAD = {
    "glued": (glued_tokenizer, r"the key 00000 shares a token with the text before it: the "
                               r"answer's tokens are \['s 0', '0', '0', '0', '0'\]"),
    "digitless": (digitless_tokenizer, r"the key 00000 does not come back from its tokens"),
}


def test_the_check_accepts_bytes_multi_digit_bpe_and_smollm2(tiny, smollm2) -> None:
    for tokenizer in (ByteTokenizer(), tiny, smollm2):
        check_passkey_tokenizer(tokenizer)


@pytest.mark.parametrize("case", list(BAD))
def test_the_check_refuses_a_tokenizer_that_splits_digits_wrongly(case) -> None:
    make, why = BAD[case]
    tokenizer = HFTokenizer(make(), eos_token="<|end_of_text|>")
    with pytest.raises(ValueError, match=f"^{why}") as raised:
        check_passkey_tokenizer(tokenizer)
    assert "\n" not in str(raised.value)


def _checkpoint(directory: Path, case: str) -> Path:
    """The debug model (320-token vocabulary) saved with the ``case`` tokenizer."""
    save_pretrained(Transformer(ModelConfig()), directory)
    BAD[case][0]().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    return directory


def _spec(tmp_path: Path, checkpoint: Path, passkey_lengths: list[int]) -> Path:
    spec = {
        "name": "digits", "run_dir": str(tmp_path / "run"),
        "model": {"from_pretrained": str(checkpoint)},
        "parallel": {"dp": 1, "cp": 1},
        "train": {"steps": 1, "global_batch": 1, "seq_len": 64},
        "eval": {"passkey_lengths": passkey_lengths},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _refusal(case: str) -> str:
    return (r"eval\.passkey_lengths: \[512\] score 5-digit pass keys, which needs a tokenizer "
            r"that writes a key as tokens of its digits alone .* but " + BAD[case][1]
            + r".*; use a model\.from_pretrained whose tokenizer does, or "
              r"eval\.passkey_lengths: \[\] \(in this model's tokenizer\)$")


@pytest.mark.parametrize("case", list(BAD))
def test_the_job_spec_refuses_it_in_one_line(tmp_path: Path, case: str) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", case)
    with pytest.raises(JobSpecError) as raised:
        load_job_spec(_spec(tmp_path, checkpoint, [512]))
    message = str(raised.value)
    assert "\n" not in message and re.search(_refusal(case), message), message
    # Without a passkey task the same checkpoint is accepted.
    load_job_spec(_spec(tmp_path, checkpoint, []))


def test_ringray_train_refuses_it_before_ray(tmp_path: Path, monkeypatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called for a refused tokenizer")

    monkeypatch.setattr(ray, "init", tripwire)
    checkpoint = _checkpoint(tmp_path / "ckpt", "glued")
    result = CliRunner().invoke(app, ["train", str(_spec(tmp_path, checkpoint, [512]))])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.search("^error: " + _refusal("glued"), lines[0]), lines[0]
    assert not (tmp_path / "run").exists()
