"""Bad training data is reported in one line that names the file and the line (issue 28,
item 6), as a plain ``ValueError`` (which the controller does not retry); and a corpus with
no documents is refused by the job spec's up-front check, before Ray and the workers start
(item 11), as is a bad first JSONL line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
import yaml
from typer.testing import CliRunner

from ringray.cli import app
from ringray.data import DirectorySource, check_data_path
from ringray.spec import JobSpecError, load_job_spec

NESTED_LINE = "[" * 100_000 + "]" * 100_000
"""A JSON line nested far deeper than Python's recursion limit."""

# case -> (the corpus's bytes, the line the message names, what it says is wrong)
BAD_JSONL: dict[str, tuple[bytes, int, str]] = {
    "invalid UTF-8": (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', 2,
                      r"not valid UTF-8 \(byte 0xff at column 11\)"),
    "nested too deeply": (b'{"text": "ok"}\n\n' + NESTED_LINE.encode() + b"\n", 3,
                          "JSON nested too deeply to parse"),
}


@pytest.mark.parametrize("case", list(BAD_JSONL))
def test_a_bad_jsonl_line_is_one_value_error_naming_file_and_line(
    tmp_path: Path, case: str
) -> None:
    data, line, what = BAD_JSONL[case]
    (tmp_path / "corpus.jsonl").write_bytes(data)
    with pytest.raises(ValueError) as raised:
        DirectorySource(tmp_path)
    assert type(raised.value) is ValueError  # not a UnicodeDecodeError, not a RecursionError
    message = str(raised.value)
    assert "\n" not in message
    assert re.fullmatch(rf"{re.escape(str(tmp_path / 'corpus.jsonl'))}:{line}: {what}", message)


def test_a_line_that_goes_bad_after_the_scan_is_named_when_read(tmp_path: Path) -> None:
    """A line rewritten (same length) after the source was built: the read names its line."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"text": "first"}\n{"text": "ab"}\n')
    source = DirectorySource(tmp_path)
    corpus.write_bytes(b'{"text": "first"}\n{"text": "\xff\xfe"}\n')
    assert source.read_document(0) == b"first"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(corpus))}:2: not valid UTF-8"):
        source.read_document(1)


def test_the_trainer_names_the_job_field_for_a_bad_line(tmp_path: Path) -> None:
    """A bad line past the first (which the up-front check does not read) fails the trainer's
    build naming data.path, the file and the line (it named only the file before)."""
    from train_cases import changed, tiny_options

    from ringray.train import Trainer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(b'{"text": "first document"}\n{"text": bad}\n')
    options = changed(tiny_options(str(tmp_path / "run")),
                      data={"source": "files", "path": str(corpus)})
    with pytest.raises(ValueError, match=rf"^data\.path: {re.escape(str(corpus / 'a.jsonl'))}"
                                         rf":2: not valid JSON"):
        Trainer(options)


# ------------------------------------------------------------------ before Ray and the workers
def _nothing(corpus: Path) -> None:
    (corpus / "README.md").write_text("not training text")


def _empty_txt(corpus: Path) -> None:
    (corpus / "empty.txt").write_bytes(b"")


def _blank_jsonl(corpus: Path) -> None:
    (corpus / "sub").mkdir()
    (corpus / "sub" / "blank.jsonl").write_text('\n{"text": ""}\n  \n')


EMPTY = {"no .txt or .jsonl file": _nothing, "a zero-byte .txt file": _empty_txt,
         "a .jsonl of blank lines and empty texts": _blank_jsonl}


def _spec(tmp_path: Path, corpus: Path) -> Path:
    spec = {"name": "data-inputs", "run_dir": str(tmp_path / "run"),
            "data": {"source": "files", "path": str(corpus)},
            "parallel": {"dp": 1, "cp": 1}, "train": {"steps": 2, "seq_len": 64},
            "eval": {"passkey_lengths": []}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("case", list(EMPTY))
def test_an_empty_corpus_is_refused_by_the_up_front_check(tmp_path: Path, case: str) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    EMPTY[case](corpus)
    with pytest.raises(ValueError, match=r"^path: no documents in "):
        check_data_path(corpus)
    expected = rf"^data\.path: no documents in '{re.escape(str(corpus))}'"
    with pytest.raises(JobSpecError, match=expected):
        load_job_spec(_spec(tmp_path, corpus))


def test_a_corpus_with_one_document_passes(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _empty_txt(corpus)
    _blank_jsonl(corpus)
    (corpus / "sub" / "z.jsonl").write_text('{"text": "one document"}\n')
    check_data_path(corpus)
    assert load_job_spec(_spec(tmp_path, corpus)).data.path == str(corpus)


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting Ray fails the test: bad data must be reported before it."""

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called for a job with bad data")

    monkeypatch.setattr(ray, "init", tripwire)


@pytest.mark.parametrize("case", ["empty corpus", "invalid UTF-8 on the first line"])
def test_ringray_train_refuses_bad_data_in_one_line_before_ray(
    tmp_path: Path, case: str, no_ray: None
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    if case == "empty corpus":
        _empty_txt(corpus)
        expected = rf"data\.path: no documents in '{re.escape(str(corpus))}'"
    else:
        (corpus / "a.jsonl").write_bytes(b'{"text": "\xff"}\n')
        expected = rf"data\.path: {re.escape(str(corpus / 'a.jsonl'))}:1: not valid UTF-8"
    result = CliRunner().invoke(app, ["train", str(_spec(tmp_path, corpus))])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.match(rf"error: {expected}", lines[0]), lines[0]
    assert not (tmp_path / "run").exists()
