"""A check that the Triton kernels address rows past 2**31 elements: one ring step's forward,
``delta`` and backward over rows whose element offsets pass 2**31, against float64 math.

    errors = overflow_probe(torch.device("cuda"), rows=270_336, document_tokens=4096)
    errors["dq"]   # max |kernel - reference| / max |reference| over the compared rows
    errors["smallest_compared_offset"] >= 2**31  # the compared rows really are that far

A 32-bit ``row × row stride`` wraps once it reaches 2**31 elements: in the ring's
``(batch, seq, heads, d)`` views the row stride is ``heads × d``, so 524,288 rows of 32
heads × 128. The probe puts every tensor the kernels read or write (Q, K, V, dO, O in
``dtype``; the float32 O, LSE, delta, dQ, dK, dV) in one allocation, row by row: row slot
``r`` holds row ``r`` of each, so every tensor's row stride is the slot's width (the sum of
theirs, or ``slot_stride``) and the last rows of all of them lie past 2**31 elements. It
runs :func:`~.triton_forward.block_forward` (merging into O/LSE),
:func:`~.triton_backward.softmax_delta_triton` and :func:`~.triton_backward.block_backward`
on a causal block pair of ``rows`` tokens (``document_tokens``: packed documents of that
length, which keeps a GPU's work at a few documents' worth per row), then compares the
last ``compare_rows`` rows of every output, and the gradients of the last ``compare_rows``
keys (causal: only those rows see them), with float64 autograd of the same rows. With the
defaults (32 query heads, 8 kv heads × 128, bfloat16) a slot is 17,472 float32 elements, so
every tensor's rows pass 2**31 elements from row 122,911 on, and 270,336 rows take 19 GB.

On CPU the kernels run in Triton's interpreter, so the rows must be few: there
``slot_stride`` makes each slot wide (untouched pages of the allocation are never
committed), and ``lead_rows`` empty slots before row 0 keep an address that a 32-bit offset
wrapped below the tensors' start inside the allocation, so that a kernel with 32-bit
offsets computes wrong numbers instead of faulting (``tests/test_triton_overflow.py``).
"""

from __future__ import annotations

import torch

from ringray.attention.backends.common import position_mask
from ringray.attention.backends.triton_backward import block_backward, softmax_delta_triton
from ringray.attention.backends.triton_forward import block_forward

TOLERANCES = {"lse": 1e-5, "delta": 1e-5, "out": 2e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}
"""Largest error relative to the reference's largest magnitude: float32 sums (LSE, delta)
against bfloat16 products rounded before their sums (the output and the gradients)."""
GPU_PROBE = {"rows": 270_336, "document_tokens": 4096}
"""The GPU check's probe: 32 query heads, 8 kv heads x 128, bf16; one 19 GB allocation."""
CPU_PROBE = {"rows": 40, "q_heads": 2, "kv_heads": 1, "head_dim": 64, "compare_rows": 8,
             "slot_stride": 2**26, "lead_rows": 32}
"""The interpreter's probe: 40 rows 2**26 float32 elements apart (row 32 at 2**31), behind
32 empty slots where a 32-bit offset's wrap of row 32 (2**31 - 2**32) lands; an 18 GiB
reservation whose untouched pages are never committed."""


def probe_failures(errors: dict[str, float]) -> list[str]:
    """What an :func:`overflow_probe` result fails: the quantities over :data:`TOLERANCES`,
    and ``"offset"`` when its compared rows did not reach 2**31 elements."""
    failed = [name for name, limit in TOLERANCES.items() if not errors[name] < limit]
    if errors["smallest_compared_offset"] < 2**31:
        failed.append("offset")
    return failed


# (name, float32?, heads are q heads?, has a head_dim axis?): the tensors of one probe.
_TENSORS = (
    ("q", False, True, True), ("k", False, False, True), ("v", False, False, True),
    ("dout", False, True, True), ("out_lowp", False, True, True),
    ("out", True, True, True), ("lse", True, True, False), ("delta", True, True, False),
    ("dq", True, True, True), ("dk", True, False, True), ("dv", True, False, True),
)


def overflow_probe(
    device: torch.device, *, rows: int, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, compare_rows: int = 64,
    document_tokens: int | None = None, slot_stride: int | None = None, lead_rows: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """One causal ring step over ``rows`` tokens laid out as the module docstring says;
    returns, for ``out``, ``lse``, ``delta``, ``dq``, ``dk`` and ``dv``, the largest error of
    the compared rows relative to the reference's largest magnitude, and
    ``smallest_compared_offset``: the smallest element offset (row × row stride, in the
    tensor's own elements) of any compared row. ``slot_stride`` is in float32 elements."""
    tensors = _probe_tensors(device, rows, q_heads, kv_heads, head_dim, dtype, slot_stride,
                             lead_rows)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name in ("q", "k", "v", "dout"):
        tensors[name].normal_(generator=generator)
    pos = torch.arange(rows, device=device)
    doc = None if document_tokens is None else torch.div(pos, document_tokens,
                                                         rounding_mode="floor")
    tokens = {"causal": True, "scale": head_dim**-0.5, "q_doc": doc, "k_doc": doc}
    t = tensors
    t["out"].zero_()
    t["lse"].fill_(float("-inf"))
    block_forward(t["q"], t["k"], t["v"], pos, pos, out=t["out"], lse=t["lse"], **tokens)
    t["out_lowp"].copy_(t["out"])  # the ring's output, in the inputs' dtype
    t["delta"].copy_(softmax_delta_triton(t["dout"], t["out_lowp"]))
    for name in ("dq", "dk", "dv"):
        t[name].zero_()
    block_backward(t["dout"], t["q"], t["k"], t["v"], t["lse"], t["delta"], pos, pos,
                   dq=t["dq"], dk=t["dk"], dv=t["dv"], **tokens)

    first = rows - compare_rows
    first_key = 0 if doc is None else int(doc[first]) * document_tokens
    want = _reference(t, pos, doc, first, first_key, head_dim**-0.5)
    errors = {}
    for name, reference in want.items():
        got = t[name][:, :, first:].double()
        largest = reference.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
        errors[name] = float((got - reference).abs().max() / largest)
    errors["smallest_compared_offset"] = float(min(
        first * tensor.stride(2) for tensor in tensors.values()))
    return errors


def _probe_tensors(device: torch.device, rows: int, q_heads: int, kv_heads: int,
                   head_dim: int, dtype: torch.dtype, slot_stride: int | None,
                   lead_rows: int) -> dict[str, torch.Tensor]:
    """The probe's tensors, ``(1, heads, rows[, head_dim])`` views into one float32
    allocation of ``lead_rows + rows`` slots (``dtype`` ones through a reinterpreting
    view of the same bytes)."""
    per_f32 = 4 // torch.empty(0, dtype=dtype).element_size()  # dtype elements per float32
    widths, column = {}, 0  # each tensor's first column in a slot, in float32 elements
    for name, is_f32, q_side, with_dim in _TENSORS:
        width = (q_heads if q_side else kv_heads) * (head_dim if with_dim else 1)
        widths[name] = column
        column += width if is_f32 else -(-width // per_f32)
    stride_f32 = slot_stride if slot_stride is not None else -(-column // 16) * 16
    if stride_f32 < column:
        raise ValueError(f"slot_stride: {slot_stride} float32 elements cannot hold a row of "
                         f"every tensor ({column})")
    storage = torch.empty((lead_rows + rows) * stride_f32, dtype=torch.float32, device=device)
    views = {True: storage, False: storage.view(dtype)}
    tensors = {}
    for name, is_f32, q_side, with_dim in _TENSORS:
        unit = 1 if is_f32 else per_f32  # own elements per float32 element
        row_stride = stride_f32 * unit
        heads = q_heads if q_side else kv_heads
        size = (1, heads, rows, head_dim) if with_dim else (1, heads, rows)
        stride = ((lead_rows + rows) * row_stride, head_dim, row_stride, 1) if with_dim \
            else ((lead_rows + rows) * row_stride, 1, row_stride)
        tensors[name] = views[is_f32].as_strided(
            size, stride, lead_rows * row_stride + widths[name] * unit)
    return tensors


def _reference(t: dict[str, torch.Tensor], pos: torch.Tensor, doc: torch.Tensor | None,
               first: int, first_key: int, scale: float) -> dict[str, torch.Tensor]:
    """Float64 ``out``, ``lse``, ``delta`` and ``dq`` of rows ``first:``, ``dk``/``dv`` of
    keys ``first:``, from the queries ``first:`` over the keys ``first_key:`` (all the
    keys those rows may see; the only queries that see keys ``first:``)."""
    q = t["q"][:, :, first:].double().requires_grad_()
    k = t["k"][:, :, first_key:].double().requires_grad_()
    v = t["v"][:, :, first_key:].double().requires_grad_()
    dout = t["dout"][:, :, first:].double()
    group = q.shape[1] // k.shape[1]
    allowed = position_mask(pos[first:], pos[first_key:], q.device, causal=True,
                            q_doc=None if doc is None else doc[first:],
                            k_doc=None if doc is None else doc[first_key:])
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse[..., None]) @ v.repeat_interleave(group, 1)
    out.backward(dout)
    delta = (dout * t["out_lowp"][:, :, first:].double()).sum(-1)
    tail = k.shape[2] - (q.shape[2])  # keys first: within keys first_key:
    return {"out": out.detach(), "lse": lse.detach(), "delta": delta, "dq": q.grad,
            "dk": k.grad[:, :, tail:], "dv": v.grad[:, :, tail:]}
