"""Input checks for :func:`ring_attention`, done before any block is sent.

Two stages. :func:`check_local` looks at this rank's arguments and raises ``ValueError``
naming the argument. :func:`agree_across_ranks` then runs one small all-reduce (25 host
integers on the group's CPU side group, :func:`~.comm.agreement_group`: no device copy, no
CUDA sync; 0.27 ms per call measured on gloo between two local processes) in which every
rank reports whether its check passed (and which argument it rejected) and what it is about
to send; if any rank failed, or the ranks disagree on shapes, dtype, layout, document
lengths or window, *every* rank raises before a single K/V block moves. So a bad call raises on the
rank that made it and cannot leave the others blocked in a receive that will never complete.

With Ulysses (a ring × Ulysses grid) the all-reduce runs in two stages, first over the
Ulysses group and then over the ring, on every rank whatever its own check said: after the
first, each rank holds the maximum of its Ulysses group; after the second, the maximum of
the ring of group maxima, which is the whole grid's. So a rank whose check failed is heard
by its Ulysses peers, by its ring peers and by every other rank of the grid, and nothing
moves (no all-to-all, no block) until everyone has agreed. What it cannot reach is a rank
that was given other groups than its peers (a rank without ``ulysses_group`` among ranks
with one): such a rank never joins its peers' all-reduce, and only the process group's own
timeout ends the wait; ranks that swap or mislay their groups consistently are caught by
:func:`~ringray.attention.ulysses.check_grid`.

A :class:`RingAgreement` kept for a ring context runs the all-reduce once per call
signature rather than once per call (its docstring says what that gives up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ringray.attention.backends import BlockAttentionBackend, resolve_backend
from ringray.attention.comm import RingComm
from ringray.attention.documents import Documents, check_documents
from ringray.attention.layouts import Layout, make_layout
from ringray.attention.ulysses import UlyssesComm, check_ulysses_heads

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
# In the order they are reported: the first that differs names the disagreement (a
# different ulysses degree also changes the layout: it is named first, being the cause).
_AGREED_FIELDS = (
    "batch", "local_seq", "q_heads", "kv_heads", "head_dim", "dtype", "causal", "window",
    "transfers", "ulysses", "layout", "documents",
)
# Fields compared by checksum: a disagreement names the field, not two meaningless numbers.
_CHECKSUM_FIELDS = {"layout", "documents"}
# The arguments a rank can reject, by the name its error message starts with ("name: ...");
# the others learn which one (code = index + 1; 0: another).
_ARGUMENTS = ("q", "k", "v", "layout", "documents", "softmax_scale", "backend", "group",
              "ulysses_group", "window", "transfers")
# ``transfers``: what moves between ranks (see ring_attention).
TRANSFER_MODES = ("mask", "all")


class RingAgreement:
    """The call signatures every rank of one ring (or ring x Ulysses grid) has agreed on,
    kept for one ring context: pass the same object to each :func:`ring_attention` call
    made with that context (each rank its own object), and a call whose signature the ranks
    agreed before skips the all-reduce, so steady-state steps make no host round-trip.

    A call with a signature not yet agreed, or one whose local check failed, runs the
    all-reduce as without this object; so the first call of each signature still fails every
    rank in one line when one rank's call is bad. What it gives up: a later call that *one*
    rank alone makes differently from a signature the others had agreed (they skip the
    all-reduce and wait in the exchange, it waits in the all-reduce) is not caught in one line;
    every rank then fails on the process group's timeout. Use it where every call under the
    context is a function of what the ranks agreed, as in the trainer (the same model and
    layers on every rank, the context's layout and documents agreed by its first call)."""

    __slots__ = ("signatures",)

    def __init__(self) -> None:
        self.signatures: set[tuple[int, ...]] = set()

    @property
    def agreed_calls(self) -> int:
        """Calls that ran the all-reduce under this object and passed (one per signature;
        the rest skipped it)."""
        return len(self.signatures)

    def __repr__(self) -> str:
        return (f"RingAgreement({len(self.signatures)} signatures, "
                f"{self.agreed_calls} all-reduces)")


@dataclass(frozen=True)
class CheckedCall:
    """What a valid call resolved to."""

    layout: Layout
    scale: float
    kernel: BlockAttentionBackend
    documents: Documents | None
    signature: tuple[int, ...]  # the values of _AGREED_FIELDS, compared across ranks
    window: int | None = None  # None also when the window spans the whole sequence
    transfers: str = "mask"


def check_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: RingComm,
    layout: str | Layout | list[list[int]],
    causal: bool,
    softmax_scale: float | None,
    backend: str | BlockAttentionBackend,
    documents: Documents | list[int] | None = None,
    ulysses: int = 1,
    window: int | None = None,
    transfers: str = "mask",
) -> CheckedCall:
    """Validate this rank's arguments; ``ValueError`` names the first bad one. ``ulysses``:
    ranks per Ulysses group (the layout then covers ``comm.world_size * ulysses`` ranks)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: expected 4 dims (batch, local_seq, heads, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPE_CODES:
            raise ValueError(
                f"{name}: dtype {t.dtype} is not supported; use float16, bfloat16, "
                f"float32 or float64"
            )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} differs from q's {q.device}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's shape {tuple(k.shape)}")
    batch, local_seq, q_heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[1] != local_seq or k.shape[3] != head_dim:
        raise ValueError(
            f"k: shape {tuple(k.shape)} must match q {tuple(q.shape)} in batch, local_seq and "
            f"head_dim (only the head count may differ)"
        )
    if min(batch, local_seq, q_heads, head_dim) == 0:
        raise ValueError(f"q: every dimension must be non-empty, got shape {tuple(q.shape)}")
    kv_heads = k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(
            f"k: kv_heads={kv_heads} must divide q_heads={q_heads} (grouped-query attention)"
        )
    if ulysses > 1:
        check_ulysses_heads(q_heads, kv_heads, ulysses)
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a positive finite number, got {softmax_scale}")
    ranks = comm.world_size * ulysses
    seq_len = local_seq * ranks
    try:
        docs = check_documents(documents, seq_len)
    except ValueError as exc:
        if ranks == 1:
            raise
        raise ValueError(f"{exc} (local_seq {local_seq} x {ranks} ranks)") from None
    window = check_window(window, causal, seq_len)
    if transfers not in TRANSFER_MODES:
        raise ValueError(f"transfers: expected 'mask' (only what a reader's queries see) or "
                         f"'all' (every block to every rank, whole), got {transfers!r}")
    resolved = make_layout(layout, ranks, seq_len, documents=docs, ulysses=ulysses)
    kernel = resolve_backend(backend, q.device, q.dtype)
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    signature = (
        batch, local_seq, q_heads, kv_heads, head_dim, _DTYPE_CODES[q.dtype], int(causal),
        window or 0, TRANSFER_MODES.index(transfers), ulysses, resolved.fingerprint,
        docs.fingerprint + 1 if docs is not None else 0,
    )
    return CheckedCall(resolved, scale, kernel, docs, signature, window, transfers)


def check_window(window: object, causal: bool, seq_len: int) -> int | None:
    """A sliding window as the ring runs it: a positive integer below ``seq_len`` (a query
    sees keys at most ``window - 1`` positions before it), or ``None`` for no window, which a
    window of ``seq_len`` or more also is. Raises ``ValueError("window: ...")``."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window: expected a positive integer (keys at most window - 1 "
                         f"positions before the query) or None, got {window!r}")
    if not causal:
        raise ValueError(f"window: {window} needs causal=True (a sliding window bounds how "
                         f"far back a query looks)")
    return window if window < seq_len else None


def agree_across_ranks(
    comm: RingComm, checked: CheckedCall | None, error: ValueError | None = None,
    ulysses: UlyssesComm | None = None,
) -> None:
    """Raise on every rank unless every rank passed its local check with the same signature.

    ``checked`` is ``None`` on a rank whose local check failed with ``error``; that rank
    re-raises its own error afterwards, and the others say which argument it rejected.
    With ``ulysses`` (a group of more than one rank) the agreement spans the whole ring ×
    Ulysses grid: Ulysses group first, then the ring (see the module docstring).
    """
    size = ulysses.world_size if ulysses is not None else 1
    if comm.world_size * size == 1:
        return
    fields = checked.signature if checked is not None else (0,) * len(_AGREED_FIELDS)
    # The highest failing rank of the grid (ring_index * U + ulysses_index) and the argument
    # it rejected, packed so that MAX keeps both.
    grid_rank = comm.rank * size + (ulysses.rank if ulysses is not None else 0)
    failed = 0 if checked is not None else (grid_rank + 1) * 64 + _argument_code(error)
    # One MAX all-reduce gives both the largest and (negated) the smallest of every field.
    vector = torch.tensor([failed, *fields, *(-f for f in fields)], dtype=torch.int64)
    if size > 1:
        vector = ulysses.all_max(vector)
    result = comm.all_max(vector).tolist()  # host integers: no device sync
    if checked is None:
        return
    where = "ring" if size == 1 else "ring x ulysses grid"
    if result[0]:
        rank, code = divmod(result[0], 64)
        argument = f" ({_ARGUMENTS[code - 1]})" if code else ""
        if size == 1:
            raise ValueError(
                f"ring_attention: rank {rank - 1} of the ring rejected its inputs{argument} "
                f"(its own error says why); no block was sent"
            )
        ring_index, ulysses_index = divmod(rank - 1, size)
        raise ValueError(
            f"ring_attention: rank {rank - 1} of the {where} (ring index {ring_index}, "
            f"ulysses index {ulysses_index}) rejected its inputs{argument} (its own error "
            f"says why); no block or all-to-all was sent"
        )
    width = len(_AGREED_FIELDS)
    for i, name in enumerate(_AGREED_FIELDS):
        high, low = result[1 + i], -result[1 + width + i]
        if high != low:
            values = "" if name in _CHECKSUM_FIELDS else f" (values from {low} to {high})"
            also = ", ulysses degree" if size > 1 or name == "ulysses" else ""
            raise ValueError(
                f"ring_attention: ranks disagree on {name}{values}; every rank of the {where} "
                f"must pass the same shapes, dtype, causal flag, window, layout{also} and "
                f"documents"
            )


def _argument_code(error: ValueError | None) -> int:
    """1 + the index in ``_ARGUMENTS`` of the argument ``error`` names, or 0."""
    name = str(error).split(":", 1)[0] if error is not None else ""
    return _ARGUMENTS.index(name) + 1 if name in _ARGUMENTS else 0
