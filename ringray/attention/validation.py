"""Input checks for :func:`ring_attention`, done before any block is sent.

Two stages. :func:`check_local` looks at this rank's arguments and raises ``ValueError``
naming the argument. :func:`agree_across_ranks` then runs one small all-reduce in which every
rank reports whether its check passed (and which argument it rejected) and what it is about
to send; if any rank failed, or the ranks disagree on shapes, dtype, layout or document
lengths, *every* rank raises before a single K/V block moves. So a bad call raises on the
rank that made it and cannot leave the others blocked in a receive that will never complete.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringray.attention.backends import BlockAttentionBackend, resolve_backend
from ringray.attention.comm import RingComm
from ringray.attention.documents import Documents, check_documents
from ringray.attention.layouts import Layout, make_layout

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_AGREED_FIELDS = (
    "batch", "local_seq", "q_heads", "kv_heads", "head_dim", "dtype", "causal", "layout",
    "documents",
)
# Fields compared by checksum: a disagreement names the field, not two meaningless numbers.
_CHECKSUM_FIELDS = {"layout", "documents"}
# The arguments a rank can reject, by the name its error message starts with ("name: ...");
# the others learn which one (code = index + 1; 0: another).
_ARGUMENTS = ("q", "k", "v", "layout", "documents", "softmax_scale", "backend", "group")


@dataclass(frozen=True)
class CheckedCall:
    """What a valid call resolved to."""

    layout: Layout
    scale: float
    kernel: BlockAttentionBackend
    documents: Documents | None
    signature: tuple[int, ...]  # the values of _AGREED_FIELDS, compared across ranks


def check_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: RingComm,
    layout: str | Layout | list[list[int]],
    causal: bool,
    softmax_scale: float | None,
    backend: str,
    documents: Documents | list[int] | None = None,
) -> CheckedCall:
    """Validate this rank's arguments; ``ValueError`` names the first bad one."""
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
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a positive finite number, got {softmax_scale}")
    seq_len = local_seq * comm.world_size
    try:
        docs = check_documents(documents, seq_len)
    except ValueError as exc:
        if comm.world_size == 1:
            raise
        raise ValueError(f"{exc} (local_seq {local_seq} x {comm.world_size} ranks)") from None
    resolved = make_layout(layout, comm.world_size, seq_len, documents=docs)
    kernel = resolve_backend(backend, q.device, q.dtype)
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    signature = (
        batch, local_seq, q_heads, kv_heads, head_dim, _DTYPE_CODES[q.dtype], int(causal),
        resolved.fingerprint, docs.fingerprint + 1 if docs is not None else 0,
    )
    return CheckedCall(resolved, scale, kernel, docs, signature)


def agree_across_ranks(
    comm: RingComm, checked: CheckedCall | None, device: torch.device | None,
    error: ValueError | None = None,
) -> None:
    """Raise on every rank unless every rank passed its local check with the same signature.

    ``checked`` is ``None`` on a rank whose local check failed with ``error``; that rank
    re-raises its own error afterwards, and the others say which argument it rejected.
    """
    if comm.world_size == 1:
        return
    fields = checked.signature if checked is not None else (0,) * len(_AGREED_FIELDS)
    # The highest failing rank and the argument it rejected, packed so that MAX keeps both.
    failed = 0 if checked is not None else (comm.rank + 1) * 64 + _argument_code(error)
    # One MAX all-reduce gives both the largest and (negated) the smallest of every field.
    vector = torch.tensor([failed, *fields, *(-f for f in fields)], dtype=torch.int64)
    if dist.get_backend(comm.group) == "nccl":
        vector = vector.to(device if device is not None and device.type == "cuda" else "cuda")
    result = comm.all_max(vector).tolist()
    if checked is None:
        return
    if result[0]:
        rank, code = divmod(result[0], 64)
        argument = f" ({_ARGUMENTS[code - 1]})" if code else ""
        raise ValueError(
            f"ring_attention: rank {rank - 1} of the ring rejected its inputs{argument} (its "
            f"own error says why); no block was sent"
        )
    width = len(_AGREED_FIELDS)
    for i, name in enumerate(_AGREED_FIELDS):
        high, low = result[1 + i], -result[1 + width + i]
        if high != low:
            values = "" if name in _CHECKSUM_FIELDS else f" (values from {low} to {high})"
            raise ValueError(
                f"ring_attention: ranks disagree on {name}{values}; every rank of the ring "
                f"must pass the same shapes, dtype, causal flag, layout and documents"
            )


def _argument_code(error: ValueError | None) -> int:
    """1 + the index in ``_ARGUMENTS`` of the argument ``error`` names, or 0."""
    name = str(error).split(":", 1)[0] if error is not None else ""
    return _ARGUMENTS.index(name) + 1 if name in _ARGUMENTS else 0
