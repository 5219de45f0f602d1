"""ringray.data: byte tokenizer, document sources, the packed DP loader and passkey eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringray.data import (
    PASSKEY_DIGIT_CHANCE,
    ByteTokenizer,
    DirectorySource,
    MemorySource,
    PackedLoader,
    PasskeySource,
    StdlibSource,
    evaluate_passkey,
    make_passkey_sample,
    make_source,
    passkey_chance_accuracy,
    passkey_min_seq_len,
)

TOK = ByteTokenizer()


# --- tokenizer -------------------------------------------------------------------------


def test_tokenizer_round_trips_text_including_non_ascii():
    """encode gives one id per UTF-8 byte; decode inverts it and drops specials."""
    text = "plain ASCII, héllo wörld — 日本語 🎉\n\ttabs"
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text
    assert TOK.decode([TOK.bos_id, *ids, TOK.eos_id, TOK.pad_id, 300]) == text
    assert TOK.decode(torch.tensor(ids)) == text
    assert TOK.encode_bytes(b"\x00\xff") == [0, 255]


def test_tokenizer_ids_layout_and_invalid_input():
    """Specials follow the bytes; the vocab is padded to a multiple of 64; bad ids raise."""
    assert (TOK.bos_id, TOK.eos_id, TOK.pad_id) == (256, 257, 258)
    assert TOK.vocab_size == 320 and TOK.vocab_size % 64 == 0
    assert TOK.decode([0xFF, ord("a")]) == "\ufffda"
    for bad in (-1, 320):
        with pytest.raises(ValueError, match=f"token id {bad}"):
            TOK.decode([bad])


# --- sources ---------------------------------------------------------------------------


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)


def _all_documents(source) -> list[bytes]:
    return [source.read_document(i) for i in range(len(source))]


def test_directory_source_reads_txt_and_jsonl_recursively_in_path_order(tmp_path):
    """Documents come in relative-path order; JSONL lines are documents; empties skipped."""
    _write(tmp_path / "b" / "d" / "e.txt", "nested")
    _write(tmp_path / "a.txt", "first file\n")
    _write(tmp_path / "empty.txt", "")
    _write(tmp_path / "notes.md", "ignored")
    lines = [
        json.dumps({"text": "line one", "id": 1}),
        "",
        json.dumps({"text": ""}),
        json.dumps({"text": "ünïcode ✓"}),
    ]
    _write(tmp_path / "b" / "c.jsonl", "\n".join(lines) + "\n")

    source = DirectorySource(tmp_path)
    expected = [b"first file\n", b"line one", "ünïcode ✓".encode(), b"nested"]
    assert _all_documents(source) == expected
    assert list(source.document_lengths) == [len(d) for d in expected]
    assert "4 documents" in source.describe()


def test_directory_source_errors_name_what_was_wrong(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        DirectorySource(tmp_path / "missing")

    _write(tmp_path / "only" / "empty.txt", "")
    _write(tmp_path / "only" / "readme.md", "not a source file")
    with pytest.raises(ValueError, match=r"no documents.*\.txt.*\.jsonl"):
        DirectorySource(tmp_path / "only")

    _write(tmp_path / "bad" / "x.jsonl", '{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: .*string \"text\" field"):
        DirectorySource(tmp_path / "bad")

    _write(tmp_path / "num" / "x.jsonl", '{"text": 5}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:1: "):
        DirectorySource(tmp_path / "num")

    _write(tmp_path / "broken" / "x.jsonl", '{"text": "ok"}\n\n{not json\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:3: not valid JSON"):
        DirectorySource(tmp_path / "broken")


def test_stdlib_source_finds_many_documents_and_reads_one():
    source = StdlibSource()
    assert len(source) > 300
    assert sum(source.document_lengths) > 1_000_000
    assert min(source.document_lengths) >= 1
    assert "site-packages" not in source.describe()
    index = len(source) // 2
    data = source.read_document(index)
    assert len(data) == source.document_lengths[index]


def test_make_source_kinds_and_errors(tmp_path):
    _write(tmp_path / "a.txt", "hello")
    assert _all_documents(make_source("files", str(tmp_path))) == [b"hello"]
    assert isinstance(make_source("stdlib", None), StdlibSource)
    assert isinstance(make_source("passkey", seq_len=512), PasskeySource)
    with pytest.raises(ValueError, match=r"'web'.*'stdlib', 'files', 'passkey'"):
        make_source("web", None)
    with pytest.raises(ValueError, match="needs a directory path"):
        make_source("files", None)
    with pytest.raises(ValueError, match="only used by kind 'files'"):
        make_source("stdlib", str(tmp_path))
    with pytest.raises(ValueError, match="needs the training seq_len"):
        make_source("passkey", None)


# --- packed loader ---------------------------------------------------------------------

DOCS = ["alpha", "bravo charlie", "d", "echo foxtrot golf hotel", "india", "juliett kilo"]


def _loader(source=None, **overrides) -> PackedLoader:
    settings = dict(tokenizer=TOK, seq_len=7, global_batch=4, dp_rank=0, dp_size=1, seed=3)
    settings.update(overrides)
    return PackedLoader(source or MemorySource(DOCS), **settings)


def _reference_stream(loader: PackedLoader, epochs: int) -> torch.Tensor:
    """The stream built by hand from the source: each epoch's documents, each + eos."""
    ids: list[int] = []
    for epoch in range(epochs):
        order = loader.epoch_order(epoch)
        assert sorted(order) == list(range(len(loader.source)))
        for document in order:
            ids += list(loader.source.read_document(document)) + [TOK.eos_id]
    return torch.tensor(ids)


def test_loader_is_deterministic_in_seed_and_random_access():
    """Same seed: same batches in any access order; another seed: different batches."""
    a, b, c = _loader(seed=3), _loader(seed=3), _loader(seed=4)
    for index in (0, 5, 2, 40):
        torch.testing.assert_close(a.batch(index), b.batch(index), rtol=0, atol=0)
    assert any(not torch.equal(a.batch(i)[0], c.batch(i)[0]) for i in range(4))
    assert a.epoch_order(0) != c.epoch_order(0)
    first = a.next_batch()
    assert a.next_index == 1
    torch.testing.assert_close(first, b.batch(0), rtol=0, atol=0)


def test_loader_packs_the_epoch_stream_with_next_token_labels_across_epoch_boundaries():
    """Sequence j is stream[j*S : j*S+S+1]; the stream is epochs back to back, each a
    fresh permutation, so sequences that straddle an epoch end continue into the next."""
    loader = _loader()
    seq_len, global_batch = loader.seq_len, loader.global_batch
    epochs = 4
    stream = _reference_stream(loader, epochs)
    assert len(stream) == epochs * loader.epoch_tokens
    assert len({loader.epoch_order(e) for e in range(epochs)}) > 1
    num_batches = (len(stream) - 1) // (seq_len * global_batch)
    straddling = 0
    for index in range(num_batches):
        inputs, labels = loader.batch(index)
        assert inputs.dtype == labels.dtype == torch.long
        assert inputs.shape == labels.shape == (global_batch, seq_len)
        torch.testing.assert_close(inputs[:, 1:], labels[:, :-1])
        for row in range(global_batch):
            start = (index * global_batch + row) * seq_len
            torch.testing.assert_close(inputs[row], stream[start : start + seq_len])
            torch.testing.assert_close(labels[row], stream[start + 1 : start + seq_len + 1])
            stop = start + seq_len
            straddling += start // loader.epoch_tokens != stop // loader.epoch_tokens
    assert straddling >= epochs - 1
    assert num_batches * global_batch * seq_len > 3 * loader.epoch_tokens


def test_loader_dp_slices_concatenate_to_the_single_rank_batch():
    """Concatenating every DP rank's batch in rank order equals the dp_size=1 batch."""
    source = StdlibSource()
    settings = dict(tokenizer=TOK, seq_len=512, global_batch=8, seed=11)
    whole = PackedLoader(source, dp_rank=0, dp_size=1, **settings)
    for dp_size in (2, 4, 8):
        ranks = [
            PackedLoader(source, dp_rank=r, dp_size=dp_size, **settings) for r in range(dp_size)
        ]
        for index in (0, 7, 1234):
            parts = [loader.batch(index) for loader in ranks]
            assert parts[0][0].shape == (8 // dp_size, 512)
            want_inputs, want_labels = whole.batch(index)
            torch.testing.assert_close(torch.cat([p[0] for p in parts]), want_inputs)
            torch.testing.assert_close(torch.cat([p[1] for p in parts]), want_labels)


def test_loader_without_document_cache_returns_the_same_batches():
    """The LRU is only a cache: evicting everything changes no token."""
    cached, uncached = _loader(), _loader(cache_tokens=0)
    for index in (0, 9, 3, 9):
        torch.testing.assert_close(cached.batch(index), uncached.batch(index), rtol=0, atol=0)


def test_loader_state_round_trips_and_resumes_at_another_dp_degree():
    """state_dict holds plain ints; loading it at dp_size 2 continues the same stream."""
    trained = _loader(dp_size=1)
    for _ in range(3):
        trained.next_batch()
    state = trained.state_dict()
    assert state == {"next_index": 3, "seed": 3, "seq_len": 7, "global_batch": 4}
    json.dumps(state)
    want_inputs, want_labels = trained.next_batch()

    resumed = [_loader(dp_rank=r, dp_size=2) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
        assert loader.next_index == 3
    parts = [loader.next_batch() for loader in resumed]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), want_inputs)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), want_labels)
    assert all(loader.next_index == 4 for loader in resumed)


@pytest.mark.parametrize(("field", "value"), [("seed", 4), ("seq_len", 8), ("global_batch", 8)])
def test_loader_refuses_state_from_a_different_stream(field, value):
    loader = _loader()
    state = {**loader.state_dict(), field: value}
    old = loader.state_dict()[field]
    with pytest.raises(
        ValueError, match=f"{field}: checkpoint has {field}={value} .* {field}={old}"
    ):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="next_index"):
        loader.load_state_dict({**loader.state_dict(), "next_index": -1})
    assert loader.next_index == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(global_batch=6, dp_size=4), r"global_batch: 6 is not divisible by dp_size 4"),
        (dict(dp_rank=2, dp_size=2), r"dp_rank: 2 must be in \[0, 2\)"),
        (dict(dp_rank=-1, dp_size=2), r"dp_rank: -1 must be in \[0, 2\)"),
        (dict(seq_len=0), r"seq_len: 0 must be an integer >= 1"),
        (dict(global_batch=0), r"global_batch: 0 must be an integer >= 1"),
        (dict(dp_size=0), r"dp_size: 0 must be an integer >= 1"),
    ],
)
def test_loader_validates_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        _loader(**overrides)


def test_loader_rejects_negative_batch_index():
    with pytest.raises(ValueError, match="index: -1"):
        _loader().batch(-1)


def test_passkey_source_fills_one_packed_sequence_per_document():
    """With matching seq_len each packed sequence is one passkey prompt plus its eos."""
    source = PasskeySource(300, seed=0, num_documents=8)
    loader = PackedLoader(
        source, tokenizer=TOK, seq_len=300, global_batch=4, dp_rank=0, dp_size=1, seed=0
    )
    inputs, _ = loader.batch(1)
    for row in inputs:
        assert int(row[-1]) == TOK.eos_id
        text = TOK.decode(row[:-1])
        key = text[-5:]
        assert key.isdigit() and text.endswith(f"What is the pass key? The pass key is {key}")
        assert f"The pass key is {key}. Remember it." in text


# --- passkey ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [passkey_min_seq_len(TOK, 5), 257, 1000, 4099])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_passkey_sample_has_exact_length_and_answer_at_the_end(seq_len, depth):
    sample = make_passkey_sample(TOK, seq_len=seq_len, depth=depth, passkey="48213")
    assert sample.tokens.shape == (seq_len,) and sample.tokens.dtype == torch.long
    assert sample.answer_start == seq_len - 5
    assert TOK.decode(sample.tokens[sample.answer_start :]) == "48213"
    text = TOK.decode(sample.tokens)
    assert text.endswith("What is the pass key? The pass key is 48213")
    needle = "The pass key is 48213. Remember it. 48213 is the pass key. "
    assert text.count(needle) == 1
    assert text.index(needle) == sample.needle_start


def test_passkey_needle_position_follows_depth():
    """Needle start is monotone in depth: 0.0 is the start, 1.0 just before the question,
    0.5 near the middle of the filler."""
    seq_len = 8192
    question = len("What is the pass key? The pass key is 48213")
    needle = len("The pass key is 48213. Remember it. 48213 is the pass key. ")
    filler = seq_len - question - needle
    depths = [i / 20 for i in range(21)]
    starts = [
        make_passkey_sample(TOK, seq_len=seq_len, depth=d, passkey="48213").needle_start
        for d in depths
    ]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert starts[0] == 0
    assert starts[-1] + needle == seq_len - question
    assert abs(starts[10] / filler - 0.5) < 0.01


def test_passkey_sample_rejects_too_short_sequences_and_bad_depth():
    minimum = passkey_min_seq_len(TOK, 5)
    with pytest.raises(ValueError, match=f"the minimum is {minimum}"):
        make_passkey_sample(TOK, seq_len=minimum - 1, depth=0.5, passkey="12345")
    with pytest.raises(ValueError, match="depth: 1.5"):
        make_passkey_sample(TOK, seq_len=1024, depth=1.5, passkey="12345")


GRID = dict(lengths=[256, 384], depths=[0.0, 0.5, 1.0], samples_per_cell=20, seed=7)


def _oracle(tokens: torch.Tensor) -> torch.Tensor:
    return torch.roll(tokens, -1, dims=1)


def test_evaluate_passkey_oracle_scores_one_and_report_is_serialisable():
    report = evaluate_passkey(_oracle, TOK, batch_size=7, **GRID)
    assert report.accuracy == 1.0 and report.digit_accuracy == 1.0
    assert all(c.accuracy == 1.0 and c.samples == 20 for c in report.cells)
    assert len(report.cells) == 6
    summary = json.loads(json.dumps(report.to_dict()))
    assert summary["accuracy"] == 1.0 and summary["by_length"] == {"256": 1.0, "384": 1.0}
    assert summary["chance"]["accuracy"] == pytest.approx(1e-5)
    table = report.format_table().splitlines()
    assert len(table) == 2 + 2 + 1 + 1
    assert table[1].split() == ["length", "d=0.00", "d=0.50", "d=1.00", "all"]
    assert table[2].split() == ["256", "1.00", "1.00", "1.00", "1.00"]
    assert table[4].split()[0] == "all"


def test_evaluate_passkey_random_predictions_score_at_chance():
    """Uniform random ids over the vocab: no exact match, per-digit about 1/320."""
    generator = torch.Generator().manual_seed(0)

    def uniform(tokens: torch.Tensor) -> torch.Tensor:
        return torch.randint(0, TOK.vocab_size, tokens.shape, generator=generator)

    report = evaluate_passkey(uniform, TOK, **GRID)
    assert report.accuracy == 0.0
    assert report.digit_accuracy < 0.05


def test_evaluate_passkey_digit_guessing_scores_a_tenth_per_digit():
    """Guessing uniform digits gets about PASSKEY_DIGIT_CHANCE per digit (600 digits)."""
    generator = torch.Generator().manual_seed(1)
    digit_ids = torch.tensor(TOK.encode("0123456789"))

    def guess_digits(tokens: torch.Tensor) -> torch.Tensor:
        return digit_ids[torch.randint(0, 10, tokens.shape, generator=generator)]

    report = evaluate_passkey(guess_digits, TOK, **GRID)
    assert PASSKEY_DIGIT_CHANCE == 0.1 and passkey_chance_accuracy(5) == pytest.approx(1e-5)
    assert 0.03 < report.digit_accuracy < 0.2
    assert report.accuracy < 0.05


def test_evaluate_passkey_attributes_results_to_the_right_cells():
    """A model that only finds needles at depth 0 scores 1 there and 0 elsewhere."""
    needle_first = torch.tensor(TOK.encode("The pass key is"))

    def only_depth_zero(tokens: torch.Tensor) -> torch.Tensor:
        found = (tokens[:, : len(needle_first)] == needle_first).all(dim=1, keepdim=True)
        return torch.where(found, _oracle(tokens), torch.zeros_like(tokens))

    report = evaluate_passkey(only_depth_zero, TOK, **GRID)
    for length in GRID["lengths"]:
        assert report.cell_accuracy(length, 0.0) == 1.0
        assert report.cell_accuracy(length, 0.5) == report.cell_accuracy(length, 1.0) == 0.0
        assert report.length_accuracy(length) == pytest.approx(1 / 3)
    assert report.depth_accuracy(0.0) == 1.0
    assert report.accuracy == pytest.approx(1 / 3)


def test_evaluate_passkey_is_deterministic_and_validates():
    seen: list[torch.Tensor] = []

    def record(tokens: torch.Tensor) -> torch.Tensor:
        seen.append(tokens.clone())
        return _oracle(tokens)

    small = dict(lengths=[256], depths=[0.5], samples_per_cell=3, seed=5)
    evaluate_passkey(record, TOK, **small)
    evaluate_passkey(record, TOK, **small)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    keys = {TOK.decode(row[-5:]) for row in seen[0]}
    assert len(keys) == 3 and all(k.isdigit() for k in keys)

    with pytest.raises(ValueError, match="predict: returned shape"):
        evaluate_passkey(lambda t: t[:, :-1], TOK, **small)
    with pytest.raises(ValueError, match="lengths: \\[100\\] are below the minimum"):
        evaluate_passkey(_oracle, TOK, **{**small, "lengths": [100]})
    with pytest.raises(ValueError, match="depths"):
        evaluate_passkey(_oracle, TOK, **{**small, "depths": [0.5, 0.5]})
