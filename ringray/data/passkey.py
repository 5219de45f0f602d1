"""Synthetic passkey retrieval: can the model find a number hidden deep in a long context?

A sample is exactly ``seq_len`` tokens of any :class:`~ringray.data.tokenizer.Tokenizer`:
repeated filler sentences, a needle sentence holding the pass key at a chosen fractional
depth of the filler, and a closing question whose last tokens are the answer::

    The grass is green. The sky is blue. ... The pass key is 48213. Remember it. 48213 is
    the pass key. The sun is yellow. ... What is the pass key? The pass key is 48213

The prompt is one text tokenized as a whole, as a model would see it in running text: a BPE
writes ``green.`` ``␠The`` across a sentence boundary, not ``green.`` ``␠`` ``The``. The
filler is trimmed at its front (only the sample's first sentence may be cut, or, with the
needle first, the sentence after it) so the sample has exactly ``seq_len`` tokens, and its
tokens are what the tokenizer makes of its own decoded text (``encode(decode(tokens)) ==
tokens``).

Evaluation is teacher-forced: one forward pass over the whole sample, and the model's argmax
next-token predictions at the answer positions are decoded and compared with the answer's
text. No generation loop is needed, so it works unchanged under context parallelism, where
each rank holds a shard of the sequence and autoregressive decoding would be awkward. The
answer is whichever tokens the tokenizer makes of the key (one per digit for bytes and
SmolLM2; a BPE may use multi-digit tokens such as ``482`` ``13``), so it is scored on decoded
text. :func:`check_passkey_tokenizer` says whether a tokenizer writes keys in a way this
scoring can read.

    >>> report = evaluate_passkey(predict, ByteTokenizer(), lengths=[4096, 16384],
    ...                           depths=[0.0, 0.5, 1.0], samples_per_cell=8, seed=0)
    >>> print(report.format_table())

``predict(tokens)`` takes a ``(B, S)`` long tensor on the CPU and returns the ``(B, S)``
argmax ids (position ``i`` predicts token ``i + 1``); it moves data to its own device.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ringray.data.tokenizer import Tokenizer, encode_with_offsets

PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
"""Filler text, repeated and trimmed to length. Every sentence ends with ". "."""

MIN_FILLER_TOKENS = 64
"""Least filler a sample must hold, so that ``depth`` still means something."""

PASSKEY_DIGITS = 5
"""Digits of an evaluation's pass key (the answer a model must retrieve)."""

PASSKEY_DIGIT_CHANCE = 0.1
"""Per-digit accuracy of a model that guesses uniformly among the ten digits."""

_SENTENCE_END = ". "
_SENTENCES = tuple(text + _SENTENCE_END for text in PASSKEY_FILLER.split(_SENTENCE_END) if text)

_PLACEMENT_TRIES = 8
"""Needle positions a sample tries, nearest the requested depth first, until its tokens
round-trip: the filler's front is cut at a token, and with a tokenizer that splits a word
into several tokens a cut word's tail may re-tokenize differently (never for bytes, nor for
SmolLM2, whose filler words are one token each)."""


def _needle_text(passkey: str) -> str:
    return f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "


def _question_text(passkey: str) -> str:
    # The answer is the tail of the question, so a teacher-forced forward pass scores it.
    return f"What is the pass key? The pass key is {passkey}"


def passkey_chance_accuracy(digits: int) -> float:
    """Exact-match accuracy of uniform guessing: ``10 ** -digits``.

    A model that guesses digits uniformly gets :data:`PASSKEY_DIGIT_CHANCE` (0.1) per digit
    and ``0.1 ** digits`` for the whole key; one that spreads its argmax over the full
    vocabulary does worse (about ``1 / vocab_size`` per digit).
    """
    if digits < 1:
        raise ValueError(f"digits: {digits} must be >= 1")
    return 10.0**-digits


def _encode_marks(
    tokenizer: Tokenizer, text: str, marks: Sequence[int]
) -> tuple[list[int], list[int]]:
    """``text`` tokenized as a whole, and for each character offset in ``marks`` the index of
    the first token that ends after it: the token where the text from that offset begins (a
    BPE's ``␠The`` begins the sentence ``The ...``, though it holds the space before it)."""
    ids, spans = encode_with_offsets(tokenizer, text)
    ends = [end for _, end in spans]
    return ids, [bisect.bisect_right(ends, mark) for mark in marks]


@dataclass(frozen=True)
class _PromptTokens:
    """Token counts of a prompt's parts where a sample has them: between filler sentences."""

    needle: int
    question: int
    unit: int
    """Tokens of one :data:`PASSKEY_FILLER` (five sentences)."""
    ids: tuple[int, ...]
    """The tokens of ``filler + needle + filler + question``."""
    needle_span: tuple[int, int]
    question_start: int


def _prompt_tokens(tokenizer: Tokenizer, passkey: str) -> _PromptTokens:
    needle, question = _needle_text(passkey), _question_text(passkey)
    text = PASSKEY_FILLER + needle + PASSKEY_FILLER + question
    first = len(PASSKEY_FILLER)
    ids, (start, end, question_start) = _encode_marks(
        tokenizer, text, (first, first + len(needle), len(text) - len(question)))
    return _PromptTokens(needle=end - start, question=len(ids) - question_start, unit=start,
                         ids=tuple(ids), needle_span=(start, end),
                         question_start=question_start)


def _prompt_lengths(tokenizer: Tokenizer, passkey: str) -> tuple[int, int]:
    """Tokens of the needle and of the question for ``passkey``, in a sample's context."""
    counts = _prompt_tokens(tokenizer, passkey)
    return counts.needle, counts.question


def passkey_min_seq_len(tokenizer: Tokenizer, passkey_length: int) -> int:
    """Shortest ``seq_len`` that holds the needle, the question and the minimum filler.

    Exact for the byte tokenizer. For others, the key's three copies may tokenize into a
    different number of tokens for different keys, so this is the longest of the ten
    one-digit-repeated keys plus room for up to one token per digit in each copy (which
    :func:`check_passkey_tokenizer` checks a tokenizer keeps to).
    """
    if tokenizer.byte_level:
        return sum(_prompt_lengths(tokenizer, "0" * passkey_length)) + MIN_FILLER_TOKENS
    longest = max(sum(_prompt_lengths(tokenizer, digit * passkey_length))
                  for digit in "0123456789")
    return longest + 3 * (passkey_length - 1) + MIN_FILLER_TOKENS


@dataclass(frozen=True)
class PasskeySample:
    """One passkey prompt: ``tokens[answer_start:]`` are the pass key's tokens."""

    tokens: torch.Tensor
    """``(seq_len,)`` long tensor."""
    answer_start: int
    """Index of the first answer token; the answer runs to the end of ``tokens``."""
    needle_start: int
    """Index of the first token of the needle sentence (a BPE's ``␠The``, which holds the
    space before it, unless the needle opens the sample)."""
    passkey: str
    depth: float
    """Requested fractional depth of the needle in the filler (0 = start, 1 = end)."""
    seq_len: int


@dataclass(frozen=True)
class _Filler:
    """Filler sentences ending right before the question, tokenized as a whole once.

    ``boundaries[i]`` is the token where sentence ``i`` begins (``boundaries[-1]``: where the
    question begins), so the last ``q`` sentences hold ``boundaries[-1] - boundaries[-1 - q]``
    tokens in a sample's text.
    """

    text: str
    """The sentences, without the question."""
    starts: tuple[int, ...]
    """Character offset of each sentence in ``text``, and ``len(text)`` last."""
    boundaries: tuple[int, ...]

    @classmethod
    def build(cls, tokenizer: Tokenizer, copies: int) -> _Filler:
        """``copies`` of :data:`PASSKEY_FILLER`, tokenized with the question's first words
        after them (any key's question starts so); cached for hashable tokenizers, since every
        sample of one length and tokenizer uses the same filler."""
        try:
            return _cached_filler(tokenizer, copies)
        except TypeError:  # an unhashable tokenizer
            return cls._tokenized(tokenizer, copies)

    @classmethod
    def _tokenized(cls, tokenizer: Tokenizer, copies: int) -> _Filler:
        text = PASSKEY_FILLER * copies
        starts = [0]
        for i in range(len(_SENTENCES) * copies):
            starts.append(starts[-1] + len(_SENTENCES[i % len(_SENTENCES)]))
        _, boundaries = _encode_marks(tokenizer, text + _question_text(""), starts)
        return cls(text=text, starts=tuple(starts), boundaries=tuple(boundaries))

    def placements(self, filler_length: int) -> list[tuple[int, int | None]]:
        """``(needle position, sentences after it)`` for each sentence boundary within the
        last ``filler_length`` filler tokens, and ``(0, None)``: the needle first, the
        filler's front cut after it."""
        last = self.boundaries[-1]
        found: list[tuple[int, int | None]] = []
        for after in range(len(self.boundaries)):
            position = filler_length - (last - self.boundaries[-1 - after])
            if position < 0:
                break
            found.append((position, after))
        if all(position != 0 for position, _ in found):
            found.append((0, None))
        return found


@functools.lru_cache(maxsize=8)
def _cached_filler(tokenizer: Tokenizer, copies: int) -> _Filler:
    return _Filler._tokenized(tokenizer, copies)


def _assemble(
    tokenizer: Tokenizer, filler: _Filler, *, seq_len: int, after: int | None, passkey: str
) -> tuple[list[int], int, int] | None:
    """``(tokens, needle_start, question_start)`` of the sample whose needle has ``after``
    filler sentences behind it (``None``: the needle first), or ``None`` when it does not
    come to exactly ``seq_len`` tokens that round-trip through decode and encode."""
    needle, question = _needle_text(passkey), _question_text(passkey)
    if after is None:  # needle, filler, question: cut the filler's front, after the needle
        text = needle + filler.text + question
        ids, (start, end, question_start) = _encode_marks(
            tokenizer, text, (0, len(needle), len(text) - len(question)))
        cut = len(ids) - seq_len
        if not 0 <= cut <= question_start - end:
            return None
        tokens = ids[:end] + ids[end + cut:]
    else:  # filler, needle, filler, question: cut the text's front
        split = filler.starts[-1 - after]
        text = filler.text[:split] + needle + filler.text[split:] + question
        ids, (start, end, question_start) = _encode_marks(
            tokenizer, text, (split, split + len(needle), len(text) - len(question)))
        cut = len(ids) - seq_len
        if not 0 <= cut <= start:
            return None
        tokens = ids[cut:]
        start -= cut
    if not tokenizer.byte_level and tokenizer.encode(tokenizer.decode(tokens)) != tokens:
        return None
    return tokens, start, question_start - cut


def _answer_offset(tokenizer: Tokenizer, question: Sequence[int], passkey: str) -> int:
    """Index in ``question`` of the first answer token: the shortest tail of the question's
    tokens whose text holds the whole key (a byte tokenizer: the last ``len(passkey)``)."""
    for start in range(len(question) - 1, -1, -1):
        if passkey in tokenizer.decode(question[start:]):
            return start
    raise ValueError(f"passkey: {passkey!r} is not in the decoded question; the tokenizer does "
                     f"not round-trip digits")


def make_passkey_sample(
    tokenizer: Tokenizer, *, seq_len: int, depth: float, passkey: str
) -> PasskeySample:
    """Build a sample of exactly ``seq_len`` tokens with the needle at ``depth`` of the filler.

    The prompt's text is tokenized as a whole (see the module's docstring). The needle goes
    at the sentence boundary nearest ``depth * filler_tokens``, so depth 0.0 puts it first and
    depth 1.0 right before the question; should the nearest not round-trip (a cut word, see
    :data:`_PLACEMENT_TRIES`), the next nearest. Raises ValueError when ``seq_len`` cannot
    hold needle, question and :data:`MIN_FILLER_TOKENS` of filler.

    Cost: two tokenizations of about ``seq_len`` tokens (the sample, and its round trip) and,
    the first time a tokenizer makes a sample of this length, a third (the filler's).
    """
    if not passkey:
        raise ValueError("passkey: must be a non-empty string")
    if not (math.isfinite(depth) and 0.0 <= depth <= 1.0):
        raise ValueError(f"depth: {depth} must be in [0.0, 1.0]")
    minimum = passkey_min_seq_len(tokenizer, len(passkey))
    if seq_len < minimum:
        raise ValueError(
            f"seq_len: {seq_len} is too short for a passkey sample with a "
            f"{len(passkey)}-character key; the minimum is {minimum} (needle + question + "
            f"{MIN_FILLER_TOKENS} filler tokens)"
        )
    counts = _prompt_tokens(tokenizer, passkey)
    filler_length = seq_len - counts.needle - counts.question
    if filler_length < MIN_FILLER_TOKENS:
        raise ValueError(
            f"seq_len: {seq_len} leaves {filler_length} filler tokens for key {passkey!r}; "
            f"at least {MIN_FILLER_TOKENS} are needed"
        )
    # Room for the filler plus two spare copies, so its front can always be cut.
    copies = filler_length // max(counts.unit, 1) + 3
    filler = _Filler.build(tokenizer, copies)
    target = depth * filler_length
    placements = sorted(filler.placements(filler_length),
                        key=lambda placement: (abs(placement[0] - target), placement[0]))
    for _, after in placements[:_PLACEMENT_TRIES]:
        built = _assemble(tokenizer, filler, seq_len=seq_len, after=after, passkey=passkey)
        if built is None:
            continue
        tokens, needle_start, question_start = built
        answer_start = question_start + _answer_offset(
            tokenizer, tokens[question_start:], passkey)
        return PasskeySample(
            tokens=torch.tensor(tokens, dtype=torch.long),
            answer_start=answer_start,
            needle_start=needle_start,
            passkey=passkey,
            depth=float(depth),
            seq_len=seq_len,
        )
    raise ValueError(
        f"tokenizer: no passkey sample of {seq_len} tokens at depth {depth} whose tokens "
        f"survive decode and encode unchanged (tried the {_PLACEMENT_TRIES} needle positions "
        f"nearest it); the tokenizer re-tokenizes the cut filler differently"
    )


def _digit_runs(
    tokenizer: Tokenizer, ids: Sequence[int], limit: int | None = None
) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive tokens whose decoded text holds a digit;
    with ``limit``, only the first ``limit`` runs (reading no further than their end)."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if any(c.isdigit() for c in tokenizer.decode([token])):
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        elif limit is not None and len(runs) == limit:
            break
    return runs


def _digits_of(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The digits of ``ids`` decoded one token at a time, as :func:`score_answer` reads them."""
    return "".join(c for token in ids for c in tokenizer.decode([token]) if c.isdigit())


def passkey_retrieval_mask(tokenizer: Tokenizer, sample: PasskeySample) -> list[bool]:
    """Which of ``sample``'s tokens only retrieval can predict (``True``), for training with
    the loss on them alone: the key's repeat inside the needle (``... Remember it. 48213 is
    the pass key``, a copy from a few tokens back) and the answer at the end (a copy from
    the needle, anywhere in the context). The first copy of the key is random, and the
    filler and the fixed sentences are predictable without looking back for the key.

    The repeat is the second run of digit-holding tokens from the needle's start, so this
    holds for tokenizers that merge digits (``482`` ``13``) as well as for bytes.
    """
    tokens = sample.tokens.tolist()
    mask = [False] * len(tokens)
    runs = _digit_runs(tokenizer, tokens[sample.needle_start : sample.answer_start], limit=2)
    if len(runs) >= 2:
        start, end = runs[1]
        for i in range(sample.needle_start + start, sample.needle_start + end):
            mask[i] = True
    for i in range(sample.answer_start, len(tokens)):
        mask[i] = True
    return mask


def _probe_keys(digits: int) -> list[str]:
    """Keys that put every digit at every position, beside itself and beside the digits
    above and below it: ``00000``..``99999``, ``01234``..``90123``, ``09876``..``98765``."""
    keys = [d * digits for d in "0123456789"]
    for step in (1, -1):
        keys += ["".join(str((first + step * i) % 10) for i in range(digits))
                 for first in range(10)]
    return list(dict.fromkeys(keys))


def _key_problem(tokenizer: Tokenizer, key: str) -> str | None:
    """What about ``key``'s tokens in a sample's context the passkey task cannot read, or
    ``None``."""
    counts = _prompt_tokens(tokenizer, key)
    question = counts.ids[counts.question_start:]
    decoded = tokenizer.decode(question)
    if key not in decoded:
        return f"the key {key} does not come back from its tokens (the question decodes to " \
               f"{decoded[-40:]!r})"
    answer = question[_answer_offset(tokenizer, question, key):]
    pieces = [tokenizer.decode([token]) for token in answer]
    if tokenizer.decode(answer).lstrip() != key:
        return f"the key {key} shares a token with the text before it: the answer's " \
               f"tokens are {pieces}"
    if _digits_of(tokenizer, answer) != key:
        return f"the key {key}'s tokens {pieces}, each decoded alone as the per-digit score " \
               f"reads them, spell {_digits_of(tokenizer, answer)!r}"
    if len(answer) > len(key):
        return f"the key {key} takes {len(answer)} tokens {pieces}, more than one per digit"
    start, end = counts.needle_span
    needle = counts.ids[start:end]
    copies = [_digits_of(tokenizer, needle[a:b]) for a, b in _digit_runs(tokenizer, needle)]
    if copies != [key, key]:
        return f"the needle {_needle_text(key).strip()!r} holds the key's digits as the " \
               f"token runs {copies}, not as two runs that each spell {key}"
    return None


def check_passkey_tokenizer(tokenizer: Tokenizer, digits: int = PASSKEY_DIGITS) -> None:
    """Raise ``ValueError`` (one line) unless ``tokenizer`` writes pass keys of ``digits``
    digits the way the passkey task reads them, where a sample has them:

    - the key comes back from its tokens (decode of encode keeps the digits);
    - the answer, the shortest tail of the question's tokens whose text holds the key, holds
      nothing else but whitespace before it (no token joins a digit to a word);
    - its tokens, each decoded alone, spell the key's digits in order (how
      :func:`score_answer` counts digits); one digit or several a token are both fine;
    - the key takes at most one token per digit (the room :func:`passkey_min_seq_len`
      leaves);
    - the needle holds the key as two runs of digit tokens, each spelling the key (how
      :func:`passkey_retrieval_mask` finds the repeat).

    Probed with keys that put every digit at every position (:func:`_probe_keys`).
    """
    for key in _probe_keys(digits):
        problem = _key_problem(tokenizer, key)
        if problem is not None:
            raise ValueError(problem)


@dataclass(frozen=True)
class PasskeyCell:
    """Counts for one (length, depth) cell of the evaluation grid."""

    length: int
    depth: float
    samples: int
    exact_matches: int
    """Samples whose predicted answer decodes to the answer's text."""
    digits_correct: int
    """Key digits predicted right (see :func:`score_answer`)."""
    digits_total: int

    @property
    def accuracy(self) -> float:
        """Exact-match accuracy of this cell."""
        return self.exact_matches / self.samples

    @property
    def digit_accuracy(self) -> float:
        """Fraction of the keys' digits predicted correctly in this cell."""
        return self.digits_correct / self.digits_total


def _pooled(cells: Sequence[PasskeyCell]) -> tuple[float, float]:
    samples = sum(c.samples for c in cells)
    digits = sum(c.digits_total for c in cells)
    exact = sum(c.exact_matches for c in cells) / samples
    return exact, sum(c.digits_correct for c in cells) / digits


@dataclass(frozen=True)
class PasskeyReport:
    """Passkey results over a grid of lengths × depths, pooled by sample counts."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    samples_per_cell: int
    digits: int
    seed: int
    cells: tuple[PasskeyCell, ...]
    """One per (length, depth), in ``lengths``-major order."""

    def cell(self, length: int, depth: float) -> PasskeyCell:
        """The cell for ``(length, depth)``; KeyError if the grid has none."""
        for c in self.cells:
            if c.length == length and c.depth == depth:
                return c
        raise KeyError(f"no cell for length={length}, depth={depth}")

    def cell_accuracy(self, length: int, depth: float) -> float:
        """Exact-match accuracy at one length and depth."""
        return self.cell(length, depth).accuracy

    def length_accuracy(self, length: int) -> float:
        """Exact-match accuracy at one length, over all depths."""
        return _pooled([c for c in self.cells if c.length == length])[0]

    def depth_accuracy(self, depth: float) -> float:
        """Exact-match accuracy at one depth, over all lengths."""
        return _pooled([c for c in self.cells if c.depth == depth])[0]

    @property
    def accuracy(self) -> float:
        """Overall exact-match accuracy (the whole decoded answer right)."""
        return _pooled(self.cells)[0]

    @property
    def digit_accuracy(self) -> float:
        """Overall fraction of the keys' digits predicted correctly."""
        return _pooled(self.cells)[1]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary: settings, overall and per-length accuracy, chance, all cells."""
        return {
            "lengths": list(self.lengths),
            "depths": list(self.depths),
            "samples_per_cell": self.samples_per_cell,
            "digits": self.digits,
            "seed": self.seed,
            "accuracy": self.accuracy,
            "digit_accuracy": self.digit_accuracy,
            "chance": {
                "accuracy": passkey_chance_accuracy(self.digits),
                "digit_accuracy": PASSKEY_DIGIT_CHANCE,
            },
            "by_length": {str(n): self.length_accuracy(n) for n in self.lengths},
            "cells": [
                {
                    "length": c.length,
                    "depth": c.depth,
                    "samples": c.samples,
                    "accuracy": c.accuracy,
                    "digit_accuracy": c.digit_accuracy,
                }
                for c in self.cells
            ],
        }

    def format_table(self) -> str:
        """Exact-match accuracy as text: rows are lengths, columns depths plus "all"."""
        headers = [f"d={d:.2f}" for d in self.depths] + ["all"]
        width = max(6, *(len(h) for h in headers))
        label_width = max(6, *(len(str(n)) for n in self.lengths))

        def row(label: str, values: list[float]) -> str:
            cells = "".join(f" {v:>{width}.2f}" for v in values)
            return f"{label:>{label_width}}{cells}"

        lines = [
            f"passkey exact match ({self.digits} digits, {self.samples_per_cell} samples/cell)",
            f"{'length':>{label_width}}" + "".join(f" {h:>{width}}" for h in headers),
        ]
        for n in self.lengths:
            values = [self.cell_accuracy(n, d) for d in self.depths]
            lines.append(row(str(n), values + [self.length_accuracy(n)]))
        totals = [self.depth_accuracy(d) for d in self.depths] + [self.accuracy]
        lines.append(row("all", totals))
        lines.append(
            f"per-digit accuracy {self.digit_accuracy:.3f} (chance: exact "
            f"{passkey_chance_accuracy(self.digits):.0e}, per digit {PASSKEY_DIGIT_CHANCE})"
        )
        return "\n".join(lines)


def _random_passkey(rng: random.Random, digits: int) -> str:
    # Each digit drawn independently (leading zeros allowed), so digit chance is exactly 0.1.
    return "".join(rng.choice("0123456789") for _ in range(digits))


def _check_grid(
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples_per_cell: int,
    digits: int,
    batch_size: int,
) -> None:
    for name, value in (
        ("samples_per_cell", samples_per_cell),
        ("digits", digits),
        ("batch_size", batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name}: {value} must be >= 1")
    if not lengths or len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths: {list(lengths)} must be non-empty with no repeats")
    if not depths or len(set(depths)) != len(depths):
        raise ValueError(f"depths: {list(depths)} must be non-empty with no repeats")
    minimum = passkey_min_seq_len(tokenizer, digits)
    short = [n for n in lengths if n < minimum]
    if short:
        raise ValueError(f"lengths: {short} are below the minimum {minimum} for {digits} digits")
    bad = [d for d in depths if not (math.isfinite(d) and 0.0 <= d <= 1.0)]
    if bad:
        raise ValueError(f"depths: {bad} are outside [0.0, 1.0]")


def score_answer(
    tokenizer: Tokenizer, answer: Sequence[int], predicted: Sequence[int]
) -> tuple[bool, int, int]:
    """``(exact, digits_correct, digits_total)`` of one teacher-forced answer.

    ``exact``: the predicted tokens decode to the answer's text. Digits are scored token by
    token, since teacher forcing predicts each answer token from the true ones before it: a
    digit of answer token ``i``'s text counts as correct when predicted token ``i``'s text
    has the same character at the same offset (so ``481`` for ``482`` gets two of three).
    With the byte tokenizer this is per-token accuracy. An id outside the tokenizer's
    vocabulary (a padded embedding row) counts as wrong.
    """
    answer, predicted = [int(t) for t in answer], [int(t) for t in predicted]
    in_vocab = all(0 <= t < tokenizer.vocab_size for t in predicted)
    exact = in_vocab and tokenizer.decode(predicted) == tokenizer.decode(answer)
    correct = total = 0
    for want, got in zip(answer, predicted, strict=True):
        want_text = tokenizer.decode([want])
        got_text = tokenizer.decode([got]) if 0 <= got < tokenizer.vocab_size else ""
        for offset, char in enumerate(want_text):
            if char.isdigit():
                total += 1
                correct += offset < len(got_text) and got_text[offset] == char
    return exact, correct, total


def _score_batch(
    predict: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Tokenizer,
    samples: Sequence[PasskeySample],
) -> list[tuple[bool, int, int]]:
    """:func:`score_answer` of each sample, from one teacher-forced ``predict`` call."""
    tokens = torch.stack([s.tokens for s in samples])
    with torch.no_grad():
        predicted = predict(tokens)
    if tuple(predicted.shape) != tuple(tokens.shape):
        raise ValueError(
            f"predict: returned shape {tuple(predicted.shape)}, expected {tuple(tokens.shape)}"
        )
    predicted = predicted.to("cpu", torch.long)
    scores = []
    for row, sample in enumerate(samples):
        start, seq_len = sample.answer_start, sample.seq_len
        # Position i predicts token i + 1, so answer tokens [start, S) come from [start - 1, S - 1).
        guesses = predicted[row, start - 1 : seq_len - 1].tolist()
        scores.append(score_answer(tokenizer, sample.tokens[start:].tolist(), guesses))
    return scores


def evaluate_passkey(
    predict: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Tokenizer,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples_per_cell: int,
    seed: int,
    digits: int = PASSKEY_DIGITS,
    batch_size: int = 8,
) -> PasskeyReport:
    """Score ``predict`` on passkey samples over ``lengths`` × ``depths``.

    Pass keys are ``digits`` random digits from ``random.Random(seed)``, drawn in grid order
    (length, then depth, then sample), so a report is reproducible from its settings.
    Samples of one length are batched together, up to ``batch_size`` per ``predict`` call.
    A sample counts as correct when its predicted answer decodes to the key's text (exact
    match); per-digit accuracy counts the key's digits (:func:`score_answer`).
    """
    _check_grid(tokenizer, lengths, depths, samples_per_cell, digits, batch_size)
    rng = random.Random(seed)
    cells: list[PasskeyCell] = []
    for length in lengths:
        plan = [
            (depth, _random_passkey(rng, digits))
            for depth in depths
            for _ in range(samples_per_cell)
        ]
        scores: list[tuple[bool, int, int]] = []
        for first in range(0, len(plan), batch_size):
            samples = [
                make_passkey_sample(tokenizer, seq_len=length, depth=depth, passkey=key)
                for depth, key in plan[first : first + batch_size]
            ]
            scores.extend(_score_batch(predict, tokenizer, samples))
        for i, depth in enumerate(depths):
            cell_scores = scores[i * samples_per_cell : (i + 1) * samples_per_cell]
            cells.append(
                PasskeyCell(
                    length=length,
                    depth=float(depth),
                    samples=samples_per_cell,
                    exact_matches=sum(exact for exact, _, _ in cell_scores),
                    digits_correct=sum(correct for _, correct, _ in cell_scores),
                    digits_total=sum(total for _, _, total in cell_scores),
                )
            )
    return PasskeyReport(
        lengths=tuple(lengths),
        depths=tuple(float(d) for d in depths),
        samples_per_cell=samples_per_cell,
        digits=digits,
        seed=seed,
        cells=tuple(cells),
    )
