"""``ring_buffer_bytes_per_token`` bounds the bytes ring attention's own code allocates and
holds at once in the backward (the larger phase: what the forward allocates beyond its
buffers it saves, an activation), measured on real gloo rings of 1 to 5 ranks (zigzag,
causal, sdpa backend), in float32 and bfloat16: no rank above it, the highest rank within
one K/V block of it (the bound counts the rows a rank gathers to send as a whole block; a
zigzag reader reads half of some blocks), and equal to it on the rings where some rank
gathers a whole block's worth.

What is measured: every tensor whose storage is new and whose allocating call comes from
:mod:`ringray.attention.ring` itself (accumulators, receive buffers, gradient sums, the
final casts), tracked live by a ``TorchDispatchMode`` until its storage is freed; the peak
over the call. The kernels' own working memory (the backends' allocations) and views of
existing tensors are not counted, as the footprint counts them elsewhere or not at all.
"""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from distributed import run_gloo_ranks

from ringray.model import ModelConfig
from ringray.train.footprint import ring_buffer_bytes_per_token

HEADS, KV_HEADS, HEAD_DIM, LOCAL = 4, 2, 16, 64
RING_FILE = "ringray/attention/ring.py"


def _ring_tracker():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class RingAllocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.held: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            frame = sys._getframe(1)
            while frame is not None and ("/torch/" in frame.f_code.co_filename):
                frame = frame.f_back
            if frame is None or not frame.f_code.co_filename.endswith(RING_FILE):
                return out
            inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor)}
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if key in inputs or key in self.held or size == 0:
                    continue  # a view or an in-place result, or already counted
                self.held.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, size)
            return out

        def _freed(self, key: int, size: int) -> None:
            self.held.discard(key)
            self.live -= size

    return RingAllocations


def _rank_peaks(rank: int, world: int) -> dict[str, int]:
    """The backward's peak per dtype, in bytes."""
    from ringray.attention import ring_attention

    tracker = _ring_tracker()
    peaks = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(rank)
        q, k, v = (torch.randn(1, LOCAL, heads, HEAD_DIM, dtype=dtype, requires_grad=True)
                   for heads in (HEADS, KV_HEADS, KV_HEADS))
        out = ring_attention(q, k, v, layout="zigzag", causal=True, backend="sdpa")
        backward = tracker()
        with backward:
            out.backward(torch.randn_like(out))
        peaks[name] = backward.peak
    return peaks


# Rings of 2 and 4 in make test (4: every count at its largest); 1, 3 and 5 in make
# test-all (about 9 s each), to keep make test under 20 minutes.
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2,
                                   pytest.param(3, marks=pytest.mark.slow), 4,
                                   pytest.param(5, marks=pytest.mark.slow)])
def test_the_ring_buffers_the_plan_counts_bound_what_the_ring_allocates(world: int) -> None:
    cfg = ModelConfig(vocab_size=64, dim=HEADS * HEAD_DIM, n_layers=1, n_heads=HEADS,
                      n_kv_heads=KV_HEADS, ffn_hidden=64)
    peaks = run_gloo_ranks(world, _rank_peaks)
    for name in ("float32", "bfloat16"):
        planned = ring_buffer_bytes_per_token(cfg, cp=world, bf16=name == "bfloat16")
        measured = [rank_peaks[name] / LOCAL for rank_peaks in peaks]
        block = 2 * KV_HEADS * HEAD_DIM * (2 if name == "bfloat16" else 4)
        assert max(measured) <= planned, (name, planned, measured)
        assert max(measured) >= planned - block, (name, planned, measured)
        if world != 3:  # at 3 ranks the only K/V a rank sends back is half a block
            assert max(measured) == planned, (name, planned, measured)
