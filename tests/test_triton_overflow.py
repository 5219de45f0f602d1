"""The Triton kernels address rows whose element offsets pass 2**31, in Triton's interpreter
on CPU (``TRITON_INTERPRET=1``, set in conftest.py), without using gigabytes of memory.

A long ring block's ``row × row stride`` passes 2**31 elements (524,288 rows of 32 heads ×
128 in the ring's ``(batch, seq, heads, d)`` views); as an int32 product it wraps. The
interpreter wraps int32 products as a GPU does (pinned below), so
:func:`~ringray.attention.backends.triton_overflow.overflow_probe` shows the bug on CPU: 40
rows in slots 2**26 float32 elements apart (2**27 for bfloat16), so rows 32-39 of every
tensor lie past element 2**31, in one 18 GiB allocation of which only the rows' pages are
ever touched (Linux commits untouched pages of ``torch.empty`` lazily; the process's
resident memory is checked). 32 empty slots before row 0 keep addresses that wrapped
below the tensors inside the allocation: with int32 offsets (the kernels before issue 41)
the probe read zeros and wrote elsewhere, and its errors were 1.0 (100% of the largest
reference value) for out, dQ, dK, dV and infinite for LSE; now they are those of the same
rows at small strides. MHA (dK/dV stored by their one program) and GQA (added atomically
by the group's programs) both.

Tolerances: the bfloat16 ones of ``test_triton_backward.py`` (2% of the largest magnitude;
delta and LSE, float32 sums of exact products, 1e-5).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
triton_common = pytest.importorskip("ringray.attention.backends.triton_common")
triton_overflow = pytest.importorskip("ringray.attention.backends.triton_overflow")



def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
def test_rows_past_2_31_elements_match_float64(kv_heads: int) -> None:
    if not triton_common.kernels_interpreted():
        pytest.skip("the interpreter's scale: on a GPU, call overflow_probe at full size")
    before = _resident_bytes()
    try:
        errors = triton_overflow.overflow_probe(
            torch.device("cpu"), **{**triton_overflow.CPU_PROBE, "kv_heads": kv_heads})
    except RuntimeError as error:  # an 18 GiB reservation refused by the overcommit policy
        if "allocate" not in str(error):
            raise
        pytest.skip(f"no 18 GiB address space here: {error}")
    assert _resident_bytes() - before < 512 * 2**20  # pages of the rows only
    assert triton_overflow.probe_failures(errors) == [], errors


@pytest.mark.gpu
def test_rows_past_2_31_elements_on_cuda() -> None:
    """The same at full size on a GPU: 270,336 rows of 32 query heads, 8 kv heads × 128,
    bfloat16, in documents of 4096 tokens; one allocation of 19 GB."""
    device = torch.device("cuda")
    if torch.cuda.get_device_properties(device).total_memory < 40 * 2**30:
        pytest.skip("needs a GPU with 40 GiB")
    errors = triton_overflow.overflow_probe(device, **triton_overflow.GPU_PROBE)
    assert triton_overflow.probe_failures(errors) == [], errors


@triton.jit
def _row_offsets(OUT, first_row, row_stride, BLOCK: tl.constexpr):
    rows = first_row + tl.arange(0, BLOCK)
    tl.store(OUT + tl.arange(0, BLOCK), rows * row_stride)


def test_interpreter_wraps_int32_products() -> None:
    """What makes the test above meaningful on CPU: an int32 ``row × stride`` wraps modulo
    2**32 in the interpreter, as it does on a GPU (the 64-bit value is not kept)."""
    if not triton_common.kernels_interpreted():
        pytest.skip("checks the interpreter")
    offsets = torch.zeros(2, dtype=torch.int64)
    _row_offsets[(1,)](offsets, 2**20, 2**11, BLOCK=2)
    assert offsets.tolist() == [2**31 - 2**32, 2**31 + 2**11 - 2**32]
