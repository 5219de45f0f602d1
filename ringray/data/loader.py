"""Packed, shuffled, randomly addressable batches for one data-parallel rank.

The token stream is the infinite concatenation of epochs. Epoch ``e`` is every document of
the source once, in an order permuted deterministically by ``(seed, e)``, each document
followed by ``eos_id``; every epoch therefore has the same length
``sum(document_lengths) + len(source)``. Global sequence ``j`` is stream tokens
``[j * seq_len, j * seq_len + seq_len + 1)``: inputs are the first ``seq_len``, labels the
last ``seq_len``. Nothing is padded or dropped: a sequence that reaches the end of an epoch
simply continues with the start of the next epoch's permutation, and a document longer
than a sequence spans several. Neighbouring sequences share one token (the last label of
``j`` is the first input of ``j + 1``).

Global batch ``i`` is global sequences ``[i * global_batch, (i + 1) * global_batch)``; DP
rank ``r`` takes the contiguous slice ``[r * local, (r + 1) * local)`` with
``local = global_batch // dp_size``. Sequences come in global token order; the trainer
shards them across context-parallel ranks. Because the position (:attr:`next_index`) is
global, a checkpoint taken at one DP degree resumes at any other.

    >>> loader = PackedLoader(make_source("stdlib", None), tokenizer=ByteTokenizer(),
    ...                       seq_len=8192, global_batch=8, dp_rank=0, dp_size=2, seed=0)
    >>> inputs, labels = loader.next_batch()         # (4, 8192) long each
    >>> packed = loader.next_packed()                # ... with each row's document lengths
    >>> state = loader.state_dict()                  # store with the model checkpoint
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ringray.data.sources import TokenSource
from ringray.data.tokenizer import Tokenizer

_EPOCHS_CACHED = 4
"""Epoch orders kept in memory: a batch touches at most a few consecutive epochs."""

_MASKS_CACHED = 256
"""Documents' loss masks kept in memory (sources with a ``loss_mask`` only)."""

IGNORE_LABEL = -100
"""A label that does not count (``torch.nn.functional.cross_entropy``'s ``ignore_index``)."""


@dataclass(frozen=True)
class PackedBatch:
    """One DP rank's share of a global batch, with where its documents begin and end."""

    inputs: torch.Tensor
    """``(local_batch, seq_len)`` token ids."""
    labels: torch.Tensor
    """``(local_batch, seq_len)`` next tokens; ``IGNORE_LABEL`` at each document's last
    token, whose next token belongs to another document."""
    documents: tuple[tuple[int, ...], ...]
    """Document lengths of each row, summing to ``seq_len``."""
    counted_labels: int
    """Labels that are not ``IGNORE_LABEL`` in the whole global batch (all DP ranks)."""


@dataclass(frozen=True)
class _EpochIndex:
    """Document order of one epoch and where each document starts in the epoch's stream."""

    order: tuple[int, ...]
    starts: tuple[int, ...]
    """``starts[k]``: stream offset of document ``order[k]`` (each one is followed by eos)."""


def _check_positive_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: {value!r} must be an integer >= {minimum}")


class LoaderStateMismatch(ValueError):
    """A saved loader position taken with other stream settings: the same batch index would
    be other data. ``name`` is the loader's setting (``seed``, ``seq_len``, ``global_batch``)."""

    def __init__(self, name: str, saved: int, current: int) -> None:
        super().__init__(f"{name}: checkpoint has {name}={saved} but this loader has "
                         f"{name}={current}; the same batch index would be different data")
        self.name, self.saved, self.current = name, saved, current


class PackedLoader:
    """Batches of packed sequences for one DP rank, addressable by global batch index."""

    def __init__(
        self,
        source: TokenSource,
        *,
        tokenizer: Tokenizer,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        cache_tokens: int = 1 << 24,
    ) -> None:
        """``cache_tokens`` bounds the LRU of recently read documents (4 bytes a token).

        Documents are tokenized with ``tokenizer``; with one that is not byte-level the
        source tokenizes every document here once, to learn the lengths.
        """
        _check_positive_int("seq_len", seq_len, 1)
        _check_positive_int("global_batch", global_batch, 1)
        _check_positive_int("dp_size", dp_size, 1)
        _check_positive_int("cache_tokens", cache_tokens, 0)
        if global_batch % dp_size != 0:
            raise ValueError(
                f"global_batch: {global_batch} is not divisible by dp_size {dp_size}; use a "
                f"multiple of {dp_size} (e.g. {(global_batch // dp_size + 1) * dp_size})"
            )
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int):
            raise ValueError(f"dp_rank: {dp_rank!r} must be an integer in [0, {dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank: {dp_rank} must be in [0, {dp_size}) for dp_size {dp_size}")
        if not isinstance(seed, int):
            raise ValueError(f"seed: {seed!r} must be an integer")
        lengths = tuple(source.token_lengths(tokenizer))
        if not lengths or min(lengths) < 1:
            raise ValueError(f"source: {source.describe()} must hold non-empty documents")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.local_batch = global_batch // dp_size
        self.next_index = 0
        """Global batch index that :meth:`next_batch` returns next."""
        self._lengths = lengths
        self.epoch_tokens = sum(lengths) + len(lengths)
        """Tokens in one epoch of the stream: every document plus its eos."""
        self._cache_tokens = cache_tokens
        self._documents: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._documents_cached_tokens = 0
        self._epochs: OrderedDict[int, _EpochIndex] = OrderedDict()
        # A source that counts only some tokens in the loss says which (TokenSource).
        self._loss_mask = getattr(source, "loss_mask", None)
        self._counted: OrderedDict[int, torch.Tensor] = OrderedDict()

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """Document indices in the order they appear in ``epoch``'s stream."""
        return self._epoch_index(epoch).order

    def _epoch_index(self, epoch: int) -> _EpochIndex:
        index = self._epochs.get(epoch)
        if index is not None:
            self._epochs.move_to_end(epoch)
            return index
        order = list(range(len(self._lengths)))
        # A string seed goes through SHA-512, so distinct (seed, epoch) pairs never collide
        # and the order does not depend on PYTHONHASHSEED.
        random.Random(f"ringray-packing:{self.seed}:{epoch}").shuffle(order)
        sizes = (self._lengths[d] + 1 for d in order)
        starts = tuple(itertools.accumulate(sizes, initial=0))[:-1]
        index = _EpochIndex(order=tuple(order), starts=starts)
        self._epochs[epoch] = index
        if len(self._epochs) > _EPOCHS_CACHED:
            self._epochs.popitem(last=False)
        return index

    def _document_tokens(self, document: int) -> torch.Tensor:
        """Tokens of ``document`` followed by ``eos_id``, from the LRU when possible."""
        tokens = self._documents.get(document)
        if tokens is not None:
            self._documents.move_to_end(document)
            return tokens
        ids = list(self.source.read_tokens(document, self.tokenizer))
        if len(ids) != self._lengths[document]:
            raise ValueError(
                f"source: document {document} has {len(ids)} tokens, but its length is "
                f"{self._lengths[document]} (did the document change since the source was "
                f"built?)"
            )
        ids.append(self.tokenizer.eos_id)
        tokens = torch.tensor(ids, dtype=torch.int32)
        self._documents[document] = tokens
        self._documents_cached_tokens += len(tokens)
        while self._documents_cached_tokens > self._cache_tokens and len(self._documents) > 1:
            _, evicted = self._documents.popitem(last=False)
            self._documents_cached_tokens -= len(evicted)
        return tokens

    def stream_tokens(self, start: int, stop: int) -> torch.Tensor:
        """Tokens ``[start, stop)`` of the infinite stream, as a long tensor."""
        if start < 0 or stop < start:
            raise ValueError(f"start, stop: ({start}, {stop}) must satisfy 0 <= start <= stop")
        pieces = []
        position = start
        while position < stop:
            epoch, offset = divmod(position, self.epoch_tokens)
            index = self._epoch_index(epoch)
            slot = bisect.bisect_right(index.starts, offset) - 1
            tokens = self._document_tokens(index.order[slot])
            first = offset - index.starts[slot]
            take = min(len(tokens) - first, stop - position)
            pieces.append(tokens[first : first + take])
            position += take
        if not pieces:
            return torch.empty(0, dtype=torch.long)
        return torch.cat(pieces).long()

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` of global batch ``index`` for this DP rank.

        Both are ``(global_batch // dp_size, seq_len)`` long tensors; ``labels[b, t]`` is
        the token after ``inputs[b, t]`` in the global sequence.
        """
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index: {index!r} must be an integer >= 0")
        first_sequence = index * self.global_batch + self.dp_rank * self.local_batch
        start = first_sequence * self.seq_len
        # One contiguous read covers every sequence of this rank plus the last label token.
        span = self.stream_tokens(start, start + self.local_batch * self.seq_len + 1)
        inputs = span[:-1].view(self.local_batch, self.seq_len)
        labels = span[1:].reshape(self.local_batch, self.seq_len)
        if self._loss_mask is not None:  # the source counts only some tokens in the loss
            counted = self._stream_counted(start + 1, start + self.local_batch * self.seq_len + 1)
            labels = labels.masked_fill(~counted.view_as(labels), IGNORE_LABEL)
        return inputs, labels

    def _stream_counted(self, start: int, stop: int) -> torch.Tensor:
        """Whether each stream token ``[start, stop)`` counts in the loss, by the source's
        ``loss_mask`` (an end-of-document token never does)."""
        pieces = []
        position = start
        while position < stop:
            epoch, offset = divmod(position, self.epoch_tokens)
            index = self._epoch_index(epoch)
            slot = bisect.bisect_right(index.starts, offset) - 1
            document = index.order[slot]
            counted = self._counted.get(document)
            if counted is None:
                mask = list(self._loss_mask(document, self.tokenizer))
                if len(mask) != self._lengths[document]:
                    raise ValueError(f"source: the loss mask of document {document} has "
                                     f"{len(mask)} entries for {self._lengths[document]} tokens")
                counted = torch.tensor([*mask, False])
                self._counted[document] = counted
                if len(self._counted) > _MASKS_CACHED:
                    self._counted.popitem(last=False)
            first = offset - index.starts[slot]
            take = min(len(counted) - first, stop - position)
            pieces.append(counted[first : first + take])
            position += take
        return torch.cat(pieces)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch(next_index)``, then advance ``next_index``."""
        result = self.batch(self.next_index)
        self.next_index += 1
        return result

    # ----------------------------------------------------------------- packed documents
    def _document_ends(self, start: int, stop: int) -> list[int]:
        """Stream offsets in ``[start, stop)`` of each document's last token (its eos)."""
        ends = []
        epoch = start // self.epoch_tokens
        while epoch * self.epoch_tokens < stop:
            base = epoch * self.epoch_tokens
            index = self._epoch_index(epoch)
            first = bisect.bisect_right(index.starts, start - base) - 1
            for slot in range(max(first, 0), len(index.order)):
                end = base + index.starts[slot] + self._lengths[index.order[slot]]
                if end >= stop:
                    break
                if end >= start:
                    ends.append(end)
            epoch += 1
        return ends

    def documents(self, index: int) -> tuple[tuple[int, ...], ...]:
        """The document lengths of each of this rank's sequences of global batch ``index``
        (a sequence's first document may be the end of one that began in the previous
        sequence, its last the start of one that continues in the next). Read from the
        epoch orders alone: no token is read."""
        rows = []
        first_sequence = index * self.global_batch + self.dp_rank * self.local_batch
        for row in range(self.local_batch):
            start = (first_sequence + row) * self.seq_len
            cuts = [end - start + 1 for end in self._document_ends(start, start + self.seq_len)]
            bounds = [0, *[c for c in cuts if c < self.seq_len], self.seq_len]
            rows.append(tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False)))
        return tuple(rows)

    def packed(self, index: int) -> PackedBatch:
        """Global batch ``index`` for this rank with its document boundaries: the labels of
        each document's last token (the one before the next document) are ``IGNORE_LABEL``,
        so no token predicts across a boundary; ``counted_labels`` is the number of labels
        that count in the whole *global* batch (every DP rank's), the loss's denominator."""
        inputs, labels = self.batch(index)
        labels = labels.clone()  # a view of the inputs' buffer: mask a copy
        documents = self.documents(index)
        for row, lengths in enumerate(documents):
            ends = list(itertools.accumulate(lengths))
            # A sequence's last document continues into the next sequence unless it ends
            # exactly at the sequence's end; only a real end masks its label.
            start = (index * self.global_batch + self.dp_rank * self.local_batch + row) \
                * self.seq_len
            real = set(self._document_ends(start, start + self.seq_len))
            for end in ends:
                if start + end - 1 in real:
                    labels[row, end - 1] = IGNORE_LABEL
        return PackedBatch(inputs=inputs, labels=labels, documents=documents,
                           counted_labels=self.counted_labels(index, documents=True))

    def counted_labels(self, index: int, *, documents: bool, rows: range | None = None) -> int:
        """Labels of global batch ``index`` (every DP rank's rows, so the same number on
        each rank) that count in the loss: the loss's denominator. A source's ``loss_mask``
        leaves some out (:meth:`batch`), and with ``documents`` so does each document's last
        token (:meth:`packed`). Read from the epoch orders and the cached masks alone.
        ``rows``: only these consecutive rows of the global batch (a replica group's slice,
        :mod:`ringray.train.replicas`); the slices' counts add up to the batch's."""
        rows = range(self.global_batch) if rows is None else rows
        if rows.step != 1 or not 0 <= rows.start <= rows.stop <= self.global_batch:
            raise ValueError(f"rows: {rows} must be consecutive rows of the global batch "
                             f"(0 to {self.global_batch})")
        first = (index * self.global_batch + rows.start) * self.seq_len
        stop = first + len(rows) * self.seq_len
        if self._loss_mask is None:
            ends = len(self._document_ends(first, stop)) if documents else 0
            return stop - first - ends
        counted = self._stream_counted(first + 1, stop + 1)  # label i is token i + 1
        if documents:
            ends = torch.tensor(self._document_ends(first, stop), dtype=torch.long)
            counted[ends - first] = False
        return int(counted.sum())

    def next_packed(self) -> PackedBatch:
        """``packed(next_index)``, then advance ``next_index``."""
        result = self.packed(self.next_index)
        self.next_index += 1
        return result

    def state_dict(self) -> dict[str, int]:
        """Position and the settings it is only meaningful with (not the DP layout)."""
        return {
            "next_index": self.next_index,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
        }

    def check_state(self, state: dict[str, int]) -> None:
        """Raise :class:`LoaderStateMismatch` unless ``state`` was saved with this loader's
        stream settings (seed, sequence length, global batch), ValueError if it lacks one."""
        for name in ("seed", "seq_len", "global_batch"):
            if name not in state:
                raise ValueError(f"state: missing {name!r}")
            saved, current = state[name], getattr(self, name)
            if saved != current:
                raise LoaderStateMismatch(name, saved, current)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state["next_index"]``; ValueError if the stream settings differ."""
        self.check_state(state)
        next_index = state.get("next_index")
        if isinstance(next_index, bool) or not isinstance(next_index, int) or next_index < 0:
            raise ValueError(f"next_index: {next_index!r} must be an integer >= 0")
        self.next_index = next_index
