"""A pretrained model's tokenizer.json through ringray's data layer, with a tiny byte-level BPE
built here whose vocabulary has multi-digit tokens (``12``, ``34``, ``345``).

- ``HFTokenizer``: encode/decode round trip, EOS/BOS ids from tokenizer_config.json (or
  config.json's ``eos_token_id``), the chat template, one-line errors without an EOS.
- Passkey: samples are exactly ``seq_len`` tokens with the answer as the key's own tokens;
  scoring compares decoded text, so multi-digit tokens score per digit.
- The packed loader and the passkey source work with it (no byte-length assumption).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import fsspec
import pytest
import torch
from hf_cases import CHAT_TEMPLATE, tiny_tokenizer, write_tokenizer

from ringray.data import (
    ByteTokenizer,
    HFTokenizer,
    MemorySource,
    PackedLoader,
    PasskeySource,
    evaluate_passkey,
    make_passkey_sample,
    passkey_min_seq_len,
    score_answer,
)


@pytest.fixture
def tok(tmp_path: Path) -> HFTokenizer:
    write_tokenizer(tmp_path / "ckpt")
    return HFTokenizer.from_pretrained(str(tmp_path / "ckpt"))


def ids_of(tokenizer: HFTokenizer, *tokens: str) -> list[int]:
    return [tokenizer._tokenizer.token_to_id(t) for t in tokens]


# ------------------------------------------------------------------------------ tokenizer


def test_encode_decode_round_trip_and_special_ids(tok: HFTokenizer) -> None:
    """Text (non-ASCII included) round-trips; digits merge into multi-digit tokens; EOS and
    BOS come from tokenizer_config.json and are dropped by decode, never added by encode."""
    text = "The pass key is 12345. Ünïcødé ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == ids_of(tok, "12", "345")
    assert tok.eos_id == ids_of(tok, "<|end_of_text|>")[0]
    assert tok.bos_id == ids_of(tok, "<|begin_of_text|>")[0]
    assert tok.vocab_size == 256 + 3 + 2 and not tok.byte_level
    assert tok.eos_id not in tok.encode(text) and tok.bos_id not in tok.encode(text)
    assert tok.decode([tok.bos_id, *tok.encode("hi"), tok.eos_id]) == "hi"
    assert tok.encode_bytes("12345 é".encode()) == tok.encode("12345 é")
    with pytest.raises(ValueError, match=r"^ids: token id 261 is outside the vocabulary"):
        tok.decode([261])


def test_chat_template_renders_like_transformers(tok: HFTokenizer, tmp_path: Path) -> None:
    """The template of tokenizer_config.json renders as transformers renders it."""
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    got = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert got == "<|begin_of_text|><user>hi<|end_of_text|><assistant>yo<|end_of_text|><assistant>"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "ckpt" / "tokenizer.json"),
                                 bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    hf.chat_template = CHAT_TEMPLATE
    assert got == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_eos_from_config_json_and_equality(tmp_path: Path) -> None:
    """Without eos_token in tokenizer_config.json, config.json's eos_token_id (the first of a
    list) names it; tokenizers of the same files are equal; a memory:// URL reads too."""
    write_tokenizer(tmp_path / "a", with_eos=True)
    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    eos_id = tiny_tokenizer().token_to_id("<|end_of_text|>")
    del config["eos_token"]
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "a" / "config.json").write_text(json.dumps({"eos_token_id": [eos_id, 7]}))
    from_model_config = HFTokenizer.from_pretrained(str(tmp_path / "a"))
    assert from_model_config.eos_id == eos_id
    write_tokenizer(tmp_path / "b")
    assert HFTokenizer.from_pretrained(str(tmp_path / "b")) == from_model_config
    assert HFTokenizer.from_pretrained(str(tmp_path / "b")) != ByteTokenizer()
    fs = fsspec.filesystem("memory")
    for file in (tmp_path / "b").iterdir():
        fs.pipe(f"/tok/{file.name}", file.read_bytes())
    assert HFTokenizer.from_pretrained("memory://tok") == from_model_config
    fs.rm("/tok", recursive=True)


def test_tokenizer_without_eos_is_refused_in_one_line(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "no-eos", with_eos=False)
    with pytest.raises(ValueError, match=r"^eos_token: .*tokenizer.json has no end-of-sequence "
                                         r"token") as info:
        HFTokenizer.from_pretrained(str(tmp_path / "no-eos"))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^eos_token: '</s>' is not in the vocabulary"):
        HFTokenizer(tiny_tokenizer(), eos_token="</s>")


# ------------------------------------------------------------------------------ passkey


def test_passkey_sample_answer_is_the_keys_multi_digit_tokens(tok: HFTokenizer) -> None:
    """A sample is exactly seq_len tokens; the answer is the tokens the key became (``12``
    ``345``), found at the end, and the needle holds the key."""
    sample = make_passkey_sample(tok, seq_len=400, depth=0.5, passkey="12345")
    assert sample.tokens.shape == (400,)
    assert sample.tokens[sample.answer_start:].tolist() == ids_of(tok, "12", "345")
    text = tok.decode(sample.tokens)
    assert text.endswith("What is the pass key? The pass key is 12345")
    assert "The pass key is 12345. Remember it. 12345 is the pass key. " in text
    assert tok.decode(sample.tokens[sample.needle_start:]).startswith("The pass key is 12345.")


def test_passkey_min_seq_len_holds_every_key(tok: HFTokenizer) -> None:
    """At the minimum length every key fits (one-token-per-digit keys and merged ones)."""
    minimum = passkey_min_seq_len(tok, 5)
    keys = ["12345", "34534", "00000", "99999"] + [
        "".join(random.Random(i).choice("0123456789") for _ in range(5)) for i in range(50)]
    for key in keys:
        assert make_passkey_sample(tok, seq_len=minimum, depth=1.0, passkey=key).tokens.numel() \
            == minimum


def test_score_answer_compares_decoded_digits(tok: HFTokenizer) -> None:
    """Exact match is the decoded text; per-digit accuracy compares each predicted token's
    text with the answer token's at the same offset; an id outside the vocabulary is wrong."""
    answer = ids_of(tok, "12", "345")
    assert score_answer(tok, answer, answer) == (True, 5, 5)
    assert score_answer(tok, answer, ids_of(tok, "12", "34")) == (False, 4, 5)
    assert score_answer(tok, answer, ids_of(tok, "1", "3")) == (False, 2, 5)
    assert score_answer(tok, answer, ids_of(tok, "34", "12")) == (False, 0, 5)
    assert score_answer(tok, answer, [ids_of(tok, "12")[0], 10_000]) == (False, 2, 5)
    byte = ByteTokenizer()
    assert score_answer(byte, byte.encode("48213"), byte.encode("48113")) == (False, 4, 5)


def test_evaluate_passkey_with_multi_digit_tokens(tok: HFTokenizer) -> None:
    """The oracle scores 1; a model that predicts each answer token's last digit wrong gets
    no exact match but partial per-digit credit."""
    grid = dict(lengths=[300, 420], depths=[0.0, 0.5], samples_per_cell=6, seed=3)

    def oracle(tokens: torch.Tensor) -> torch.Tensor:
        return torch.roll(tokens, -1, dims=1)

    report = evaluate_passkey(oracle, tok, **grid)
    assert report.accuracy == 1.0 and report.digit_accuracy == 1.0
    wrong_last = {}
    for token in range(256):
        text = tok.decode([token])
        if text.isdigit():
            wrong_last[token] = tok.encode(text[:-1] + str((int(text[-1]) + 1) % 10))[0]

    def off_by_one(tokens: torch.Tensor) -> torch.Tensor:
        shifted = torch.roll(tokens, -1, dims=1)
        return shifted.apply_(lambda t: wrong_last.get(t, t))

    report = evaluate_passkey(off_by_one, tok, **grid)
    assert report.accuracy == 0.0 and 0.0 < report.digit_accuracy < 1.0


# ------------------------------------------------------------------------------ loader


def test_packed_loader_with_a_bpe_tokenizer(tok: HFTokenizer) -> None:
    """The stream is each document's BPE tokens plus EOS, in epoch order, so token counts
    are not byte lengths; batches decode back to the documents."""
    documents = ["alpha 12345 beta", "gamma é δ", "345 345 345 12 12", "x" * 40]
    source = MemorySource(documents)
    loader = PackedLoader(source, tokenizer=tok, seq_len=16, global_batch=2, dp_rank=0,
                          dp_size=1, seed=0)
    order = loader.epoch_order(0)
    stream = [t for d in order for t in tok.encode(documents[d]) + [tok.eos_id]]
    assert loader.epoch_tokens == len(stream) != sum(len(d.encode()) + 1 for d in documents)
    inputs, labels = loader.batch(0)
    assert inputs.flatten().tolist() == stream[:32]
    assert labels.flatten().tolist() == stream[1:33]
    text = tok.decode(loader.stream_tokens(0, loader.epoch_tokens))
    assert text == "".join(documents[d] for d in order)


def test_passkey_source_with_a_bpe_tokenizer(tok: HFTokenizer) -> None:
    """Passkey training documents are built in the loader's tokenizer: one prompt plus EOS
    fills each packed sequence exactly."""
    source = PasskeySource(300, seed=0, num_documents=6)
    loader = PackedLoader(source, tokenizer=tok, seq_len=300, global_batch=3, dp_rank=0,
                          dp_size=1, seed=0)
    inputs, _ = loader.batch(1)
    for row in inputs:
        assert int(row[-1]) == tok.eos_id
        text = tok.decode(row[:-1])
        key = text[-5:]
        assert key.isdigit() and text.endswith(f"What is the pass key? The pass key is {key}")
        assert f"The pass key is {key}. Remember it." in text
    with pytest.raises(ValueError, match="seq_len: .* too short"):
        PackedLoader(PasskeySource(passkey_min_seq_len(ByteTokenizer(), 5) + 1, seed=0),
                     tokenizer=tok, seq_len=64, global_batch=1, dp_rank=0, dp_size=1, seed=0)
