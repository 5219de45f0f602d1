"""Tokenizers: byte-level (the presets'), and a pretrained model's ``tokenizer.json``.

Both satisfy :class:`Tokenizer`, which is all the sources, the packed loader and the passkey
task use. Byte-level tokens (ids 0..255 are the UTF-8 bytes, then a few special ids) need no
vocabulary file and no download, make a document's token count equal to its byte length (so
sources can report lengths from file sizes without reading), and give long sequences
cheaply, which is what context-parallel training wants to exercise.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode([tok.bos_id, 104, 195, 169, tok.eos_id])
    'hé'

    >>> tok = HFTokenizer.from_pretrained("ckpt/")   # tokenizer.json (+ tokenizer_config.json)
    >>> tok.decode(tok.encode("The pass key is 48213"))
    'The pass key is 48213'
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import fsspec
import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Tokenizer(Protocol):
    """What ringray's data layer needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Ids are in ``[0, vocab_size)``; the model's vocabulary must be at least this."""
        ...

    @property
    def eos_id(self) -> int:
        """End of document: the packed loader puts one after every document."""
        ...

    @property
    def bos_id(self) -> int | None:
        """Beginning of sequence, if the tokenizer has one (never added by ``encode``)."""
        ...

    @property
    def byte_level(self) -> bool:
        """One token per UTF-8 byte, so a document's token count is its byte length."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        ...

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of a document's raw bytes (UTF-8 text), no special tokens added."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with special tokens dropped; ``ValueError`` for an id outside
        ``[0, vocab_size)``."""
        ...

BYTE_VOCAB = 256
"""Number of byte ids; ids below this are raw UTF-8 bytes."""

_BYTE_SPECIALS = {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|pad|>"}
"""The byte tokenizer's specials (ids 256, 257, 258) as :meth:`ByteTokenizer.save_hf` names
them."""


def _byte_characters() -> list[str]:
    """The printable character that byte-level BPE (GPT-2's convention, which the
    ``tokenizers`` ByteLevel pre-tokenizer uses) writes for each byte value 0..255: printable
    Latin-1 bytes stand for themselves, the others are shifted past 255 in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = [], 0
    for byte in range(BYTE_VOCAB):
        if byte in keep:
            chars.append(chr(byte))
        else:
            chars.append(chr(BYTE_VOCAB + shifted))
            shifted += 1
    return chars


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens plus ``bos``/``eos``/``pad`` specials.

    ``vocab_size`` is 320, not 259: the embedding and output matrices are padded up to a
    multiple of 64 so their shapes tile evenly into tensor-core matmuls. Ids 259..319 are
    never produced; :meth:`decode` drops them like the specials.
    """

    bos_id: int = field(default=256, init=False)
    """Beginning of sequence (not added by :meth:`encode`; the packed loader does not use it)."""
    eos_id: int = field(default=257, init=False)
    """End of document: the packed loader puts one after every document."""
    pad_id: int = field(default=258, init=False)
    """Padding, for callers that need fixed shapes; never produced by the loader."""
    vocab_size: int = field(default=320, init=False)
    """Embedding rows: 259 used ids rounded up to a multiple of 64 for matmul-friendly shapes."""

    @property
    def byte_level(self) -> bool:
        """Always: one token per byte."""
        return True

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes (no specials added)."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of raw bytes: one id per byte, so ``len`` is preserved."""
        return list(data)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode`, and each token's ``(start, end)`` character span in ``text`` (every
        byte of a multi-byte character spans the whole character)."""
        if text.isascii():
            return list(text.encode("ascii")), [(i, i + 1) for i in range(len(text))]
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            data = char.encode("utf-8")
            ids.extend(data)
            spans.extend([(i, i + 1)] * len(data))
        return ids, spans

    def save_hf(self, directory: str) -> None:
        """Write this tokenizer as a Hugging Face ``tokenizer.json`` (+ tokenizer_config.json)
        that encodes every text to the same ids, so a model trained on bytes and exported
        (``ringray export``) can be read back with ``model.from_pretrained``: a byte-level BPE
        without merges whose vocabulary maps each byte's GPT-2 character to the byte's value,
        then the specials at 256, 257, 258."""
        vocab = {char: byte for byte, char in enumerate(_byte_characters())}
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        specials = [_BYTE_SPECIALS[name] for name in ("bos", "eos", "pad")]
        tokenizer.add_special_tokens(specials)
        fs, root = fsspec.core.url_to_fs(directory)
        root = root.rstrip("/")
        fs.makedirs(root, exist_ok=True)
        fs.pipe(f"{root}/tokenizer.json", tokenizer.to_str().encode())
        config = {f"{name}_token": token for name, token in _BYTE_SPECIALS.items()}
        config["model_max_length"] = 1 << 24
        fs.pipe(f"{root}/tokenizer_config.json", json.dumps(config, indent=2).encode())

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: special and unused ids are dropped, invalid UTF-8 is replaced.

        Accepts anything iterable whose items convert with ``int`` (a list, or a 1-D tensor).
        Raises ValueError for ids outside ``[0, vocab_size)``, which means a bug upstream.
        """
        data = bytearray()
        for raw in ids:
            token = int(raw)
            if token < 0 or token >= self.vocab_size:
                raise ValueError(
                    f"ids: token id {token} is outside the vocabulary [0, {self.vocab_size})"
                )
            if token < BYTE_VOCAB:
                data.append(token)
        return data.decode("utf-8", errors="replace")


def _check_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    checked = [int(i) for i in ids]
    for token in checked:
        if token < 0 or token >= vocab_size:
            raise ValueError(f"ids: token id {token} is outside the vocabulary [0, {vocab_size})")
    return checked


def encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``tokenizer.encode(text)`` and each token's ``(start, end)`` character span in ``text``.

    Uses the tokenizer's own ``encode_with_offsets`` (:class:`ByteTokenizer`,
    :class:`HFTokenizer`); for another :class:`Tokenizer`, spans come from decoding each token
    alone, which needs a tokenizer whose tokens decode to consecutive pieces of ``text``
    (``ValueError`` otherwise).
    """
    method = getattr(tokenizer, "encode_with_offsets", None)
    if method is not None:
        return method(text)
    ids = tokenizer.encode(text)
    spans, position = [], 0
    for token in ids:
        piece = tokenizer.decode([token])
        if text[position : position + len(piece)] != piece:
            raise ValueError(f"tokenizer: {type(tokenizer).__name__} has no encode_with_offsets "
                             f"and its tokens do not decode to consecutive pieces of the text")
        spans.append((position, position + len(piece)))
        position += len(piece)
    return ids, spans


def _json_object(text: str, where: str) -> dict:
    """The JSON object in ``text`` (a file's content); ``ValueError`` naming ``where``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to parse as JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {json.dumps(value)[:40]}")
    return value


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (through the ``tokenizers`` library), with the EOS and
    BOS tokens and the chat template of its ``tokenizer_config.json``.

    ``encode`` adds no special tokens (the packed loader adds EOS itself); ``decode`` drops
    them. Two instances are equal when they tokenize identically (same tokenizer.json and
    specials), which the packed loader checks against its source's tokenizer.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token: str | None,
        bos_token: str | None = None,
        chat_template: str | None = None,
        name: str = "tokenizer.json",
    ) -> None:
        """``ValueError`` (one line) when ``eos_token`` is missing or not in the vocabulary:
        packing documents needs an end-of-document token."""
        self._tokenizer = tokenizer
        self.name = name
        self.chat_template = chat_template
        if eos_token is None:
            raise ValueError(f"eos_token: {name} has no end-of-sequence token (no eos_token in "
                             f"tokenizer_config.json, no eos_token_id in config.json); the "
                             f"packed loader needs one after every document")
        self.eos_token, self.bos_token = eos_token, bos_token
        self._eos_id = self._special_id("eos_token", eos_token)
        self._bos_id = self._special_id("bos_token", bos_token) if bos_token else None
        self._fingerprint = (tokenizer.to_str(), eos_token, bos_token)

    def _special_id(self, field_name: str, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field_name}: {token!r} is not in the vocabulary of {self.name}")
        return token_id

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """The tokenizer of a checkpoint directory (local or fsspec URL): ``tokenizer.json``,
        and ``tokenizer_config.json`` (EOS/BOS tokens, chat template) if present; an EOS
        named only by config.json's ``eos_token_id`` (the first, if a list) also counts."""
        path = os.fspath(path)
        fs, root = fsspec.core.url_to_fs(path)
        root = root.rstrip("/")

        def where(name: str) -> str:
            return f"{path.rstrip('/')}/{name}"

        def read(name: str) -> str | None:
            file = f"{root}/{name}"
            if not fs.exists(file):
                return None
            data = fs.cat_file(file)
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where(name)}: not UTF-8 text (byte "
                                 f"{data[exc.start]:#04x} at offset {exc.start})") from None

        def read_object(name: str) -> dict:
            text = read(name)
            return {} if text is None else _json_object(text, where(name))

        text = read("tokenizer.json")
        if text is None:
            raise ValueError(f"{path}: no tokenizer.json")
        try:
            tokenizer = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            raise ValueError(f"{where('tokenizer.json')}: not a tokenizer the tokenizers "
                             f"library reads ({reason})") from None
        config = read_object("tokenizer_config.json")
        eos = _token_content(config.get("eos_token"))
        if eos is None:
            eos_id = read_object("config.json").get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
            eos = tokenizer.id_to_token(eos_id) if isinstance(eos_id, int) else None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        template = template or read("chat_template.jinja")
        return cls(tokenizer, eos_token=eos, bos_token=_token_content(config.get("bos_token")),
                   chat_template=template, name=f"{path.rstrip('/')}/tokenizer.json")

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def byte_level(self) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_bytes(self, data: bytes) -> list[int]:
        return self.encode(data.decode("utf-8", errors="replace"))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode`, and each token's ``(start, end)`` character span in ``text``."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, list(encoding.offsets)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=True)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False
    ) -> str:
        """``messages`` (``{"role": ..., "content": ...}``) rendered with the chat template,
        as transformers renders it (a sandboxed Jinja environment)."""
        if self.chat_template is None:
            raise ValueError(f"chat_template: {self.name} has none (tokenizer_config.json has "
                             f"no chat_template)")
        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token, bos_token=self.bos_token or "",
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and self._fingerprint == other._fingerprint

    def __hash__(self) -> int:
        return hash(self._fingerprint)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"
