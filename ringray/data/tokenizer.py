"""Byte-level tokenizer: token ids 0..255 are the UTF-8 bytes, then a few special ids.

Byte-level tokens need no vocabulary file and no download, make a document's token count
equal to its byte length (so sources can report lengths from file sizes without reading),
and give long sequences cheaply, which is what context-parallel training wants to exercise.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode([tok.bos_id, 104, 195, 169, tok.eos_id])
    'hé'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

BYTE_VOCAB = 256
"""Number of byte ids; ids below this are raw UTF-8 bytes."""


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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes (no specials added)."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of raw bytes: one id per byte, so ``len`` is preserved."""
        return list(data)

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
