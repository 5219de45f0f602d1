"""Local block-attention backends against float64 math, every piece kind, forward and
backward, including rows that see no key and causal squares large enough to be split.
``triton`` runs in Triton's interpreter on CPU (conftest.py sets ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from ringray.attention import backends
from ringray.attention.backends import (
    BACKENDS,
    FusedStepBackend,
    resolve_backend,
)
from ringray.attention.backends.common import position_mask
from ringray.attention.backends.sdpa import CPU_CAUSAL_LEAF, causal_quadtree
from ringray.attention.pieces import PieceKind

CPU = torch.device("cpu")


def math64(q, k, v, dout, allowed, scale):
    """Float64 attention with an explicit (Sq, Sk) mask; returns out, lse, dq, dk, dv."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    kf, vf = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = probs @ vf
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def allowed_for(kind, q_pos, k_pos):
    if kind is PieceKind.FULL:
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if kind is PieceKind.CAUSAL:
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool).tril()
    return q_pos[:, None] >= k_pos[None, :]


def inputs(sq, sk, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(2, hkv, sk, d, generator=g).to(dtype)
    v = torch.randn(2, hkv, sk, d, generator=g).to(dtype)
    dout = torch.randn(2, hq, sq, d, generator=g).to(dtype)
    return q, k, v, dout


def check_backend(name, kind, sq, sk, q_pos, k_pos, dtype=torch.float32, hkv=2, tol=2e-5):
    backend = BACKENDS[name]()
    q, k, v, dout = inputs(sq, sk, hkv=hkv, dtype=dtype)
    scale = 0.3
    extra = {"q_pos": q_pos, "k_pos": k_pos} if kind is PieceKind.MASKED else {}
    out, lse = backend.forward(q, k, v, kind=kind, scale=scale, **extra)
    allowed = allowed_for(kind, q_pos, k_pos)
    want_out, want_lse, want_dq, want_dk, want_dv = math64(q, k, v, dout, allowed, scale)
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)
    # The backward takes the final output and LSE (here: of this block alone).
    dq, dk, dv = backend.backward(dout, q, k, v, want_out.to(dtype), want_lse.to(lse.dtype),
                                  kind=kind, scale=scale, **extra)
    for got, want in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=tol * 5, rtol=tol * 5)
    return lse


NAMES = ["reference", "sdpa", "triton"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_full_and_causal_pieces(name, hkv):
    pos = torch.arange(40)
    check_backend(name, PieceKind.FULL, 24, 40, pos[:24] + 100, pos, hkv=hkv)
    check_backend(name, PieceKind.CAUSAL, 40, 40, pos, pos, hkv=hkv)


@pytest.mark.parametrize("size", [CPU_CAUSAL_LEAF + 1, 3 * CPU_CAUSAL_LEAF + 17])
def test_sdpa_splits_large_causal_squares_exactly(size):
    pos = torch.arange(size)
    check_backend("sdpa", PieceKind.CAUSAL, size, size, pos, pos, tol=5e-5)


@pytest.mark.parametrize("size,leaf", [(1, 4), (5, 4), (16, 4), (37, 8), (300, 128)])
def test_causal_quadtree_covers_the_triangle_once(size, leaf):
    grid = torch.zeros(size, size, dtype=torch.int32)
    for causal, r0, r1, k0 in causal_quadtree(size, leaf):
        if causal:
            assert r1 - r0 <= leaf
            grid[r0:r1, k0:r1] += torch.ones(r1 - r0, r1 - r0, dtype=torch.int32).tril()
        else:
            grid[r0:r1, k0:r0] += 1
    assert torch.equal(grid, torch.ones(size, size, dtype=torch.int32).tril())


@pytest.mark.parametrize("name", NAMES)
def test_masked_piece_with_rows_that_see_no_key(name):
    """Rows whose keys all lie in the future: out 0, lse -inf, finite zero gradients."""
    g = torch.Generator().manual_seed(3)
    q_pos = torch.randperm(64, generator=g)[:12]
    k_pos = torch.randperm(64, generator=g)[:20]
    q_pos[0] = -1  # sees nothing
    lse = check_backend(name, PieceKind.MASKED, 12, 20, q_pos, k_pos)
    assert torch.isneginf(lse[:, :, 0]).all()
    assert torch.isfinite(lse[:, :, 1:][lse[:, :, 1:] > -1e30]).all()


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_inputs(name):
    pos = torch.arange(32)
    check_backend(name, PieceKind.CAUSAL, 32, 32, pos, pos, dtype=torch.bfloat16, tol=2e-2)


def test_reference_runs_in_float64():
    pos = torch.arange(16)
    lse = check_backend("reference", PieceKind.CAUSAL, 16, 16, pos, pos, dtype=torch.float64,
                        tol=1e-12)
    assert lse.dtype == torch.float64


def test_resolve_backend_choices_and_errors():
    assert resolve_backend("auto", CPU, torch.float32).name == "sdpa"
    assert resolve_backend("reference", CPU, torch.float64).name == "reference"
    assert resolve_backend("triton", CPU, torch.bfloat16).name == "triton"  # interpreted
    with pytest.raises(ValueError,
                       match="unknown backend 'flash'; valid: auto, reference, sdpa, triton"):
        resolve_backend("flash", CPU, torch.float32)
    with pytest.raises(ValueError, match="'sdpa' does not support torch.int32"):
        resolve_backend("sdpa", CPU, torch.int32)
    with pytest.raises(ValueError, match="'triton' does not support torch.float64"):
        resolve_backend("triton", CPU, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_picks_triton_on_cuda_when_installed_else_sdpa(dtype, monkeypatch):
    """``backend="auto"`` resolves to triton on CUDA when the triton package is importable,
    to sdpa on CUDA without it, and to sdpa on CPU always, even here, where Triton's
    interpreter would let the triton backend run on CPU."""
    cuda = torch.device("cuda")  # resolving needs no device: support is decided by type
    assert BACKENDS["triton"]().supports(CPU, dtype)  # so auto must skip it on purpose
    assert resolve_backend("auto", CPU, dtype).name == "sdpa"
    assert resolve_backend("auto", cuda, dtype).name == "triton"
    monkeypatch.setattr(backends, "triton_importable", lambda: False)
    assert resolve_backend("auto", cuda, dtype).name == "sdpa"
    with pytest.raises(ValueError, match="'triton' needs the triton package"):
        resolve_backend("triton", cuda, dtype)


def test_auto_falls_through_to_a_backend_that_takes_the_dtype():
    """float64 on CUDA: neither triton nor PyTorch's CUDA SDPA kernels take it, so auto goes
    on to the reference; on CPU SDPA takes it. A dtype nothing takes is one error."""
    assert resolve_backend("auto", torch.device("cuda"), torch.float64).name == "reference"
    assert resolve_backend("auto", CPU, torch.float64).name == "sdpa"
    with pytest.raises(ValueError, match="no backend supports torch.int32 on cpu"):
        resolve_backend("auto", CPU, torch.int32)


def test_only_triton_offers_the_fused_ring_step():
    assert isinstance(BACKENDS["triton"](), FusedStepBackend)
    assert not isinstance(BACKENDS["sdpa"](), FusedStepBackend)
    assert not isinstance(BACKENDS["reference"](), FusedStepBackend)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("q_len", "k_len"), [(256, 256), (200, 136)])
def test_sdpa_cuda_kernels_match_float64(dtype, q_len, k_len):
    """The CUDA flash (half) and memory-efficient (float32, masked) paths, with lengths that
    are not multiples of the efficient kernel's bias (16) and LSE (32) alignment, and a masked
    piece with documents."""
    backend = BACKENDS["sdpa"]()
    q_all, k_all = torch.arange(q_len), torch.arange(k_len)
    kinds = [PieceKind.FULL, PieceKind.MASKED, "documents"]
    if q_len == k_len:  # the ring's causal pieces are squares
        kinds.append(PieceKind.CAUSAL)
    for kind in kinds:
        q, k, v, dout = (t.cuda() for t in inputs(q_len, k_len, hq=8, hkv=2, d=64, dtype=dtype))
        extra = {}
        if kind == "documents":
            kind = PieceKind.MASKED
            q_doc, k_doc = q_all * 3 // q_len, k_all * 3 // k_len
            extra = {"q_pos": q_all + k_len, "k_pos": k_all, "q_doc": q_doc, "k_doc": k_doc}
        elif kind is PieceKind.MASKED:
            extra = {"q_pos": q_all.flip(0) + k_len // 2, "k_pos": k_all}
        allowed = (position_mask(extra["q_pos"], extra["k_pos"], torch.device("cpu"),
                                 q_doc=extra.get("q_doc"), k_doc=extra.get("k_doc"))
                   if extra else allowed_for(kind, q_all, k_all))
        out, lse = backend.forward(q, k, v, kind=kind, scale=0.125, **extra)
        want = math64(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), allowed, 0.125)
        tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        seen = want[1] > float("-inf")
        torch.testing.assert_close(out.double().cpu(), want[0], atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double().cpu()[seen], want[1][seen], atol=tol, rtol=tol)
        grads = backend.backward(dout, q, k, v, want[0].to(dtype).cuda(), want[1].float().cuda(),
                                 kind=kind, scale=0.125, **extra)
        for got, ref in zip(grads, want[2:], strict=True):
            torch.testing.assert_close(got.double().cpu(), ref, atol=tol * 5, rtol=tol * 5)
