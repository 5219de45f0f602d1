"""Named document mixes: the document lengths of one packed sequence, for benchmarks and the
plan (``ringray bench ring --documents``, ``ringray plan --documents``).

    document_lengths("stdlib", 16384)        # [5218, 4681, 3389, 2675, 227, 97, 97]
    document_lengths("lognormal:512", 8192)  # lengths drawn (seed 0), mean 512
    document_lengths("lognormal:1024:2", 65536)  # a long tail: median 164, longest 18892
    document_lengths("fixed:1000", 2500)     # [1000, 1000, 500]
"""

from __future__ import annotations

import itertools
import math
import random

DOCUMENT_SPECS = ("stdlib", "lognormal:MEAN[:SIGMA]", "fixed:LEN")
LOGNORMAL_SIGMA = 1.0  # default spread of the lognormal document lengths (natural-log units)


def document_lengths(spec: str, seq_len: int) -> list[int]:
    """Document lengths packed greedily into ``seq_len`` tokens, the last one cut to fit.

    ``stdlib``: the standard-library corpus (:class:`ringray.data.StdlibSource`) in its own
    order; with the byte tokenizer a document's token count is its byte length.
    ``lognormal:MEAN``: lengths drawn (seed 0) from a lognormal of mean ``MEAN`` tokens and
    sigma :data:`LOGNORMAL_SIGMA`; ``lognormal:MEAN:SIGMA`` sets the sigma (2 gives a long
    tail: a few documents many times the median among many short ones). ``fixed:LEN``:
    every document ``LEN`` tokens. Raises ``ValueError("documents: ...")`` on a bad spec.
    """
    kind, _, value = spec.partition(":")
    sigma = LOGNORMAL_SIGMA
    parts = {"lognormal": 3, "fixed": 2, "stdlib": 1}.get(kind)
    if parts is not None and spec.count(":") >= parts:
        form = next(s for s in DOCUMENT_SPECS if s.startswith(kind))
        raise ValueError(f"documents: {spec!r}: too many ':' parts; the form is {form}")
    if kind == "lognormal" and value.count(":") == 1:
        value, _, spread = value.partition(":")
        try:
            sigma = float(spread)
        except ValueError:
            sigma = 0
        if not (0 < sigma <= 4):
            raise ValueError(f"documents: {spec!r}: SIGMA must be a number in (0, 4], "
                             f"e.g. lognormal:{value}:2")
    if kind == "stdlib" and not value:
        from ringray.data.sources import StdlibSource

        return _pack(iter(StdlibSource().document_lengths), seq_len)
    if kind in ("lognormal", "fixed") and value:
        try:
            number = float(value) if kind == "lognormal" else int(value)
        except ValueError:
            number = 0
        if number >= 1 and math.isfinite(number):
            if kind == "fixed":
                return _pack(itertools.repeat(number), seq_len)
            rnd = random.Random(0)
            mu = math.log(number) - sigma**2 / 2  # so that the mean is `number`
            return _pack((round(rnd.lognormvariate(mu, sigma))
                          for _ in itertools.count()), seq_len)
        what = "MEAN must be a number" if kind == "lognormal" else "LEN must be a whole number"
        raise ValueError(f"documents: {spec!r}: {what} of tokens >= 1, e.g. {kind}:512")
    raise ValueError(f"documents: unknown spec {spec!r}; valid: {', '.join(DOCUMENT_SPECS)}")


def _pack(lengths, seq_len: int) -> list[int]:
    """Lengths (each at least 1) taken in order until they fill ``seq_len``; the last is cut."""
    packed: list[int] = []
    total = 0
    for length in lengths:
        take = min(max(1, int(length)), seq_len - total)
        packed.append(take)
        total += take
        if total == seq_len:
            return packed
    raise ValueError(f"documents: the corpus holds only {total} tokens, fewer than the "
                     f"sequence's {seq_len}")
