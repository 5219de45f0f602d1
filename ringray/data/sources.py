"""Token sources: fixed, ordered lists of documents with known lengths and random access.

A source holds documents as text (UTF-8 bytes) and gives them as any tokenizer's tokens. With
the byte tokenizer a document's token count is its byte length, so a source reports every
length from file sizes without reading anything; with another tokenizer
(:class:`~ringray.data.tokenizer.HFTokenizer`) :meth:`TokenSource.token_lengths` tokenizes
each document once to count. The packed loader uses the lengths to find which documents a
batch needs and reads only those.

    >>> source = make_source("files", "corpus/")       # .txt and .jsonl files, recursively
    >>> source = make_source("stdlib", None)           # Python's own standard library
    >>> len(source), source.document_lengths[0], source.read_document(0)[:20]

Empty documents are skipped by every source, so every length is at least 1.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Protocol

from annotated_types import MinLen

from ringray.data.passkey import PasskeySample, make_passkey_sample, passkey_retrieval_mask
from ringray.data.tokenizer import ByteTokenizer, Tokenizer

SOURCE_KINDS = ("stdlib", "files", "passkey", "passkey_retrieval")
"""Kinds accepted by :func:`make_source`."""

SourceKind = Literal[SOURCE_KINDS]


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """What a job trains on (the job spec's ``data`` section); :func:`make_source` builds it."""

    source: SourceKind = "stdlib"
    """Training text: 'stdlib' (the Python standard library's source files, no setup), 'files'
    (the .txt/.jsonl files under data.path), 'passkey' (synthetic passkey-retrieval samples,
    one per sequence) or 'passkey_retrieval' (the same samples with the loss only on the tokens
    that retrieval predicts: the key's repeat in the needle and the answer)."""
    path: Annotated[str, MinLen(1)] | None = None
    """Local directory of .txt/.jsonl files, read recursively (source 'files' only); must exist
    where the job is loaded."""
    seed: int = 0
    """Document order seed (the loader is deterministic)."""
    documents: bool = False
    """Keep packed documents apart: attention stays within each document (causal inside it,
    none across), no token's loss predicts the next document's first token, and the ring's
    layout (parallel.layout: auto) balances the documents' work."""
    document_positions: bool = True
    """With documents: RoPE positions restart at 0 in each document (false: they run over the
    whole sequence)."""

    def __post_init__(self) -> None:
        if self.path is not None and "://" in self.path:
            raise ValueError(f"path: {self.path!r} is a URL; the data loader reads a local "
                             f"directory")
        if self.source == "files" and not self.path:
            raise ValueError("path: required when source is 'files'; give a directory of "
                             ".txt/.jsonl files")
        if not self.documents and not self.document_positions:
            raise ValueError("document_positions: false only applies with documents: true "
                             "(without documents positions always run over the sequence)")
        if self.source != "files" and self.path:
            raise ValueError(f"path: only read when source is 'files' (it is "
                             f"{self.source!r}); remove it or set source: files")


class TokenSource(Protocol):
    """What the packed loader needs from a corpus."""

    @property
    def document_lengths(self) -> Sequence[int]:
        """Byte length of every document, in source order; all >= 1 (the byte tokenizer's
        token counts)."""
        ...

    def read_document(self, index: int) -> bytes:
        """The bytes of document ``index``; ``len`` equals ``document_lengths[index]``."""
        ...

    def token_lengths(self, tokenizer: Tokenizer) -> Sequence[int]:
        """Token count of every document under ``tokenizer`` (no EOS); all >= 1."""
        ...

    def read_tokens(self, index: int, tokenizer: Tokenizer) -> list[int]:
        """Document ``index`` as ``tokenizer``'s ids (no EOS); ``token_lengths`` long."""
        ...

    def __len__(self) -> int: ...

    def describe(self) -> str:
        """One line for logs: what this source is and how big."""
        ...

    # A source may also define ``loss_mask(index, tokenizer) -> list[bool]``: which tokens of
    # document ``index`` are predicted with a loss (``True``); the packed loader then labels
    # every other token ``IGNORE_LABEL`` (see :class:`PasskeySource`, ``loss="retrieval"``).


@dataclass(frozen=True)
class _FileDocument:
    """Where one document's bytes live: a whole file, or the ``"text"`` of one JSONL line."""

    path: Path
    length: int
    """Document length in bytes (UTF-8 of the text, for a JSONL line)."""
    line_offset: int = -1
    """Byte offset of the JSONL line in its file; -1 for a whole-file document."""
    line_bytes: int = 0
    line_number: int = 0
    """1-based number of the JSONL line, for messages; 0 for a whole-file document."""

    def read(self) -> bytes:
        if self.line_offset < 0:
            data = self.path.read_bytes()
        else:
            with self.path.open("rb") as f:
                f.seek(self.line_offset)
                data = _jsonl_text(f.read(self.line_bytes), f"{self.path}:{self.line_number}")
        if len(data) != self.length:
            raise ValueError(
                f"{self.path}: document is now {len(data)} bytes, was {self.length} when the "
                "source was built (the file changed on disk)"
            )
        return data


def _jsonl_text(line: bytes, where: str) -> bytes:
    """UTF-8 bytes of the ``"text"`` field of one JSONL line; a one-line ValueError naming
    ``where`` (``file:line``) for anything else, so a bad line fails the job once instead of
    being retried as a worker error."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not valid UTF-8 (byte {line[error.start]:#04x} at column "
                         f"{error.start + 1})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg} at column "
                         f"{error.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to parse") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(f'{where}: expected a JSON object with a string "text" field')
    # Lone surrogates (legal in JSON) cannot be UTF-8; replacing them keeps lengths stable.
    return text.encode("utf-8", errors="replace")


def _scan_jsonl(path: Path) -> Iterator[_FileDocument]:
    """The documents of a JSONL file, one per line with non-empty text, in order."""
    offset = 0
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                text = _jsonl_text(line, f"{path}:{line_number}")
                if text:
                    yield _FileDocument(path, len(text), offset, len(line), line_number)
            offset += len(line)


def _data_files(root: Path) -> list[Path]:
    """The ``.txt`` and ``.jsonl`` files under ``root``, recursively, by relative path."""
    return sorted(
        (p for p in root.rglob("*") if p.suffix in DirectorySource.SUFFIXES and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def _file_documents(root: Path) -> Iterator[_FileDocument]:
    """Every document under ``root`` in source order, read lazily: a non-empty ``.txt``
    file whole, and each JSONL line with non-empty text."""
    for file in _data_files(root):
        if file.suffix == ".jsonl":
            yield from _scan_jsonl(file)
        elif (size := file.stat().st_size) > 0:
            yield _FileDocument(file, size)


def _no_documents(root: Path) -> ValueError:
    return ValueError(
        f"path: no documents in {str(root)!r} (looked for non-empty .txt files and .jsonl "
        'lines with a "text" field, recursively)'
    )


def check_data_path(path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` (one line) unless ``path`` is a directory holding at least one
    document for :class:`DirectorySource`. Reads only as far as the first document, so it is
    cheap enough to run before a job starts; the workers' :class:`DirectorySource` still
    validates every JSONL line."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"path: {str(root)!r} is not a directory")
    if next(_file_documents(root), None) is None:
        raise _no_documents(root)


class _TextDocuments:
    """Tokens of text documents (a subclass gives ``document_lengths``, ``read_document`` and
    ``__len__``): bytes through the tokenizer. For the byte tokenizer the lengths are the
    byte lengths; otherwise every document is read and tokenized once to count."""

    def token_lengths(self, tokenizer: Tokenizer) -> Sequence[int]:
        if tokenizer.byte_level:
            return self.document_lengths
        lengths = tuple(len(self.read_tokens(i, tokenizer)) for i in range(len(self)))
        empty = [i for i, n in enumerate(lengths) if n < 1]
        if empty:
            raise ValueError(f"source: document {empty[0]} has no tokens under {tokenizer!r}")
        return lengths

    def read_tokens(self, index: int, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode_bytes(self.read_document(index))


class _OnDiskSource(_TextDocuments):
    """Documents that live in files and are read when the loader first needs them."""

    _documents: tuple
    _lengths: tuple[int, ...]

    @property
    def document_lengths(self) -> Sequence[int]:
        return self._lengths

    def read_document(self, index: int) -> bytes:
        return self._documents[index].read()

    def __len__(self) -> int:
        return len(self._documents)


class DirectorySource(_OnDiskSource):
    """Every ``.txt`` and ``.jsonl`` file under ``path``, recursively, by relative path.

    A ``.txt`` file is one document (its raw bytes); each non-blank line of a ``.jsonl``
    file is one document, the UTF-8 of its ``"text"`` string. JSONL files are parsed once
    here (to validate them and learn lengths); text files are only ``stat``-ed.
    """

    SUFFIXES = (".txt", ".jsonl")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = Path(path)
        if not self.root.is_dir():
            raise ValueError(f"path: {str(self.root)!r} is not a directory")
        documents = tuple(_file_documents(self.root))
        if not documents:
            raise _no_documents(self.root)
        self._documents = documents
        self._lengths = tuple(d.length for d in documents)

    def describe(self) -> str:
        return f"files:{self.root} ({len(self)} documents, {sum(self._lengths)} tokens)"


def _stdlib_files(root: Path) -> list[tuple[str, Path, int]]:
    found = []
    for directory, subdirs, names in os.walk(root):
        # Third-party packages are not the standard library (and differ between machines).
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
        for name in names:
            if not name.endswith(".py"):
                continue
            file = Path(directory, name)
            try:
                size = file.stat().st_size
            except OSError:
                continue
            if size > 0 and os.access(file, os.R_OK):
                found.append((file.relative_to(root).as_posix(), file, size))
    return sorted(found)


class StdlibSource(_OnDiskSource):
    """The ``.py`` files of Python's standard library: long real text on any machine.

    Lengths come from file sizes, so construction only walks the directory (tens of
    milliseconds); a file is read when the loader first needs it. The exact set of files
    depends on the Python build, so runs are reproducible per interpreter, not across them.
    """

    def __init__(self) -> None:
        self.root = Path(sysconfig.get_paths()["stdlib"])
        found = _stdlib_files(self.root)
        if not found:
            raise ValueError(f"no readable .py files under the standard library at {self.root}")
        self._documents = tuple(_FileDocument(file, size) for _, file, size in found)
        self._lengths = tuple(size for _, _, size in found)

    def describe(self) -> str:
        return f"stdlib:{self.root} ({len(self)} documents, {sum(self._lengths)} tokens)"


class MemorySource(_TextDocuments):
    """Documents held in memory (strings are UTF-8 encoded); empty ones are dropped.

    For tests and small experiments.
    """

    def __init__(self, documents: Sequence[str | bytes]) -> None:
        encoded = (d.encode("utf-8") if isinstance(d, str) else bytes(d) for d in documents)
        self._documents = tuple(d for d in encoded if d)
        if not self._documents:
            raise ValueError("documents: no non-empty documents given")
        self._lengths = tuple(len(d) for d in self._documents)

    @property
    def document_lengths(self) -> Sequence[int]:
        return self._lengths

    def read_document(self, index: int) -> bytes:
        return self._documents[index]

    def __len__(self) -> int:
        return len(self._documents)

    def describe(self) -> str:
        return f"memory ({len(self)} documents, {sum(self._lengths)} tokens)"


PASSKEY_SOURCE_DOCUMENTS = 1 << 16
"""Distinct samples of a :class:`PasskeySource` (an epoch). Samples are made on demand, so
this costs nothing but the epoch order; it is large so that a run of thousands of steps keeps
seeing new keys (with 1024, the debug model memorised the epoch's keys in 1500 steps of 8
sequences and scored 0.05 on unseen ones)."""


class PasskeySource:
    """Synthetic passkey samples as training documents, generated on demand.

    Each document is a passkey sample of ``seq_len - 1`` tokens of the loader's tokenizer
    (random depth, random ``digits``-digit key, both from ``(seed, index)``). With the
    end-of-document token the packed loader appends, every document fills exactly one packed
    sequence of ``seq_len`` when the loader uses the same ``seq_len``. Samples are built from
    tokens, not text (re-tokenizing a sample's text could change its length), so
    :meth:`read_document` is the byte tokenizer's sample. Use a different seed space from
    evaluation: :func:`~ringray.data.passkey.evaluate_passkey` draws keys from
    ``random.Random(seed)``.

    ``loss="retrieval"`` gives the source a :meth:`loss_mask`: only the tokens that retrieval
    predicts (:func:`~ringray.data.passkey.passkey_retrieval_mask`) count in the loss, so a
    small model's gradient is not spent on the filler it has long learned. ``"all"``: every
    token counts (the source has no loss mask).
    """

    def __init__(
        self, seq_len: int, seed: int, *, num_documents: int = PASSKEY_SOURCE_DOCUMENTS,
        digits: int = 5, loss: Literal["all", "retrieval"] = "all",
    ) -> None:
        if num_documents < 1:
            raise ValueError(f"num_documents: {num_documents} must be >= 1")
        if digits < 1:
            raise ValueError(f"digits: {digits} must be >= 1")
        if loss not in ("all", "retrieval"):
            raise ValueError(f"loss: {loss!r} is not 'all' or 'retrieval'")
        self.seq_len = seq_len
        self.seed = seed
        self.digits = digits
        self.loss = loss
        if loss == "all":
            self.loss_mask = None  # the loader then counts every label
        self._tokenizer = ByteTokenizer()
        # Build one sample now so a too-short seq_len fails here, not inside the loader.
        make_passkey_sample(self._tokenizer, seq_len=seq_len - 1, depth=0.0, passkey="0" * digits)
        self._lengths = (seq_len - 1,) * num_documents

    @property
    def document_lengths(self) -> Sequence[int]:
        return self._lengths

    def read_document(self, index: int) -> bytes:
        return bytes(self.read_tokens(index, self._tokenizer))

    def token_lengths(self, tokenizer: Tokenizer) -> Sequence[int]:
        # Build one sample now so a too-short seq_len fails here, not inside the loader.
        make_passkey_sample(tokenizer, seq_len=self.seq_len - 1, depth=0.0,
                            passkey="0" * self.digits)
        return self._lengths

    def _sample(self, index: int, tokenizer: Tokenizer) -> PasskeySample:
        if not 0 <= index < len(self._lengths):
            raise IndexError(f"index: {index} outside [0, {len(self._lengths)})")
        rng = random.Random(f"ringray-passkey-source:{self.seed}:{index}")
        depth = rng.random()
        passkey = "".join(rng.choice("0123456789") for _ in range(self.digits))
        return make_passkey_sample(
            tokenizer, seq_len=self.seq_len - 1, depth=depth, passkey=passkey
        )

    def read_tokens(self, index: int, tokenizer: Tokenizer) -> list[int]:
        return self._sample(index, tokenizer).tokens.tolist()

    def loss_mask(self, index: int, tokenizer: Tokenizer) -> list[bool]:
        """``loss="retrieval"``: which tokens of document ``index`` count in the loss."""
        return passkey_retrieval_mask(tokenizer, self._sample(index, tokenizer))

    def __len__(self) -> int:
        return len(self._lengths)

    def describe(self) -> str:
        loss = ", loss on retrieval tokens" if self.loss == "retrieval" else ""
        return (f"passkey (seq_len {self.seq_len}, seed {self.seed}, {len(self)} "
                f"documents{loss})")


def make_source(
    kind: str, path: str | None = None, *, seq_len: int | None = None, seed: int = 0
) -> TokenSource:
    """Build a source by name: ``"stdlib"``, ``"files"`` (needs ``path``), ``"passkey"`` or
    ``"passkey_retrieval"`` (need ``seq_len``; ``seed`` picks the samples; the second puts the
    loss on the retrieval tokens only)."""
    if kind not in SOURCE_KINDS:
        raise ValueError(f"kind: {kind!r} is not a source kind; valid kinds: {SOURCE_KINDS}")
    if kind != "files" and path is not None:
        raise ValueError(f"path: {path!r} is only used by kind 'files', not {kind!r}")
    if kind == "files":
        if path is None:
            raise ValueError("path: kind 'files' needs a directory path")
        return DirectorySource(path)
    if kind in ("passkey", "passkey_retrieval"):
        if seq_len is None:
            raise ValueError(f"seq_len: kind {kind!r} needs the training seq_len")
        return PasskeySource(seq_len, seed,
                             loss="retrieval" if kind == "passkey_retrieval" else "all")
    return StdlibSource()
