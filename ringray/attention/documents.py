"""Packed documents: which global positions belong to the same document.

Long-context training packs many documents into one sequence. Attention then stays inside a
document: causal within it (full within it when ``causal=False``) and empty across documents.
A :class:`Documents` holds the document lengths of the *global* sequence, in order; a document
is a contiguous range of global positions, so query ``q`` may see key ``k`` exactly when

    doc(q) == doc(k)  and  (not causal or q >= k)

which is the one rule every backend applies (:func:`~.backends.common.position_mask` on
tensors, :func:`~.tiles.classify_tile_pair` and ``visible`` in the Triton
kernels) and that the step planner (:mod:`.pieces`) turns into kernel calls.

    docs = check_documents([5, 1, 10], seq_len=16)
    docs.ids.tolist()        # [0, 0, 0, 0, 0, 1, 2, 2, ...]
    docs.token_work(True)    # visible keys per query position: 1..5, 1, 1..10
"""

from __future__ import annotations

import bisect
import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=True)
class Documents:
    """Document lengths of a global sequence (positive, in order). Build with
    :func:`check_documents`, which validates them; immutable and hashable."""

    lengths: tuple[int, ...]

    def __hash__(self) -> int:  # lengths can be long: hash the cached checksum instead
        return self.fingerprint

    @property
    def seq_len(self) -> int:
        return self.bounds[-1]

    @cached_property
    def bounds(self) -> tuple[int, ...]:
        """Start of every document, then the sequence length: document ``d`` covers
        ``bounds[d] .. bounds[d + 1] - 1``."""
        out = [0]
        for length in self.lengths:
            out.append(out[-1] + length)
        return tuple(out)

    @cached_property
    def ids(self) -> torch.Tensor:
        """Document index of every global position, ``(seq_len,)`` int64 (read-only by
        contract)."""
        return torch.repeat_interleave(torch.arange(len(self.lengths)),
                                       torch.tensor(self.lengths))

    @cached_property
    def fingerprint(self) -> int:
        """A 31-bit checksum of the lengths, used to check that all ranks agree on them."""
        digest = zlib.crc32(f"documents:{len(self.lengths)}".encode())
        digest = zlib.crc32(torch.tensor(self.lengths, dtype=torch.int64).numpy().tobytes(),
                            digest)
        return digest & 0x7FFFFFFF

    def doc_of(self, position: int) -> int:
        """The document that holds global ``position``."""
        return bisect.bisect_right(self.bounds, position) - 1

    def token_work(self, causal: bool = True) -> torch.Tensor:
        """Keys each global position sees, ``(seq_len,)`` int64: its offset in its document
        plus one under the causal rule, else its document's length."""
        starts = torch.tensor(self.bounds[:-1])[self.ids]
        if causal:
            return torch.arange(self.seq_len) - starts + 1
        return torch.tensor(self.lengths)[self.ids]


def check_documents(
    documents: Documents | Sequence[int] | torch.Tensor | None, seq_len: int
) -> Documents | None:
    """Validate document lengths for a global sequence of ``seq_len`` tokens.

    ``documents`` is ``None`` (one attention span over the whole sequence), a
    :class:`Documents`, or the lengths as a sequence (or 1-D tensor) of positive integers
    summing to ``seq_len``. Raises ``ValueError("documents: ...")`` naming what is valid.
    """
    if documents is None:
        return None
    if isinstance(documents, Documents):
        raw = documents.lengths
    else:
        if isinstance(documents, torch.Tensor):
            if documents.dim() != 1 or documents.dtype.is_floating_point:
                raise ValueError(
                    f"documents: expected a 1-D integer tensor of document lengths, got "
                    f"{documents.dtype} of shape {tuple(documents.shape)}"
                )
            documents = documents.tolist()
        if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
            raise ValueError(
                f"documents: expected a list of positive document lengths, got "
                f"{type(documents).__name__}"
            )
        raw = tuple(documents)
    if not raw:
        raise ValueError("documents: the list is empty; give the length of every document of "
                         "the global sequence (positive integers summing to it)")
    lengths = tuple(_as_int(x) for x in raw)
    for index, length in enumerate(lengths):
        if length is None or length < 1:
            raise ValueError(
                f"documents: length {index} is {raw[index]!r}; every document length must be "
                f"a positive integer"
            )
    total = sum(lengths)
    if total != seq_len:
        raise ValueError(
            f"documents: the {len(lengths)} lengths sum to {total} but the global sequence has "
            f"{seq_len} tokens; give the lengths of every document of the whole sequence "
            f"(all ranks' tokens), summing to {seq_len}"
        )
    return documents if isinstance(documents, Documents) else Documents(lengths)


def _as_int(value: object) -> int | None:
    """``value`` as an int when it is an integer (Python or NumPy, not bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
