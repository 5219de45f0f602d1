"""Local block-attention backends against float64 math, every piece kind, forward and
backward, including rows that see no key and causal squares large enough to be split.
``triton`` runs in Triton's interpreter on CPU (conftest.py sets ``TRITON_INTERPRET=1``);
``routed`` on CPU sends every piece to SDPA. The dense library kernels (cuDNN, PyTorch's
flash, flash-attn, FA3) need a GPU: their tests are marked ``gpu``, as is the check that a
masked SDPA piece on CUDA builds its mask without a host synchronisation."""

from __future__ import annotations

import pytest
import torch

from ringray.attention import backends
from ringray.attention.backends import (
    BACKENDS,
    FusedStepBackend,
    resolve_backend,
)
from ringray.attention.backends import common as backends_common
from ringray.attention.backends import dense as dense_module
from ringray.attention.backends import routed as routed_module
from ringray.attention.backends.common import position_mask
from ringray.attention.backends.dense import library_kernels
from ringray.attention.backends.routed import RoutedBackend
from ringray.attention.backends.sdpa import CPU_CAUSAL_LEAF, causal_quadtree
from ringray.attention.merge import merge_into
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


NAMES = ["reference", "sdpa", "triton", "routed"]


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
    assert resolve_backend("routed", CPU, torch.float32).name == "routed"
    with pytest.raises(ValueError, match="unknown backend 'flash'; valid: auto, reference, "
                                         "sdpa, triton, routed"):
        resolve_backend("flash", CPU, torch.float32)
    with pytest.raises(ValueError, match="'sdpa' does not support torch.int32"):
        resolve_backend("sdpa", CPU, torch.int32)
    with pytest.raises(ValueError, match="'triton' does not support torch.float64"):
        resolve_backend("triton", CPU, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_picks_triton_on_cuda_when_installed_else_sdpa(dtype, monkeypatch):
    """Where no library dense kernel runs (none here: set so on a GPU machine too),
    ``backend="auto"`` resolves to triton on CUDA when the triton package is importable, to
    sdpa on CUDA without it, and to sdpa on CPU always, even here, where Triton's
    interpreter would let the triton backend run on CPU."""
    cuda = torch.device("cuda")  # resolving needs no device: support is decided by type
    monkeypatch.setattr(routed_module, "library_kernels", lambda: ())
    assert BACKENDS["triton"]().supports(CPU, dtype)  # so auto must skip it on purpose
    assert resolve_backend("auto", CPU, dtype).name == "sdpa"
    assert resolve_backend("auto", cuda, dtype).name == "triton"
    monkeypatch.setattr(backends, "triton_importable", lambda: False)
    assert resolve_backend("auto", cuda, dtype).name == "sdpa"
    with pytest.raises(ValueError, match="'triton' needs the triton package"):
        resolve_backend("triton", cuda, dtype)


def _a_gpu_with_torch_flash(monkeypatch) -> None:
    """Resolve as on an sm90 GPU whose torch has its flash kernel built (nothing runs)."""
    monkeypatch.setattr(dense_module, "_gpu_generation",
                        lambda device: 9 if device.type == "cuda" else None)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_routes_half_precision_on_cuda_where_a_library_kernel_runs(dtype, monkeypatch):
    """With PyTorch's flash kernel there, ``auto`` on CUDA is the routed backend for half
    dtypes, its dense candidates the library kernels that run plus Triton and SDPA, its
    masked backend Triton (SDPA without Triton); on CPU still sdpa, measuring nothing."""
    cuda = torch.device("cuda")
    _a_gpu_with_torch_flash(monkeypatch)
    backend = resolve_backend("auto", cuda, dtype)
    assert isinstance(backend, RoutedBackend)
    assert backend.choices.path == routed_module.default_choices_path()
    running = [k.name for k in backend.dense_kernels(cuda) if k.supports(cuda, dtype)]
    assert "flash" in running and running[-2:] == ["triton", "sdpa"]
    assert backend.masked_backend(cuda, dtype).name == "triton"
    monkeypatch.setattr(backends, "triton_importable", lambda: False)
    monkeypatch.setattr(routed_module, "triton_importable", lambda: False)
    backend = resolve_backend("auto", cuda, dtype)
    assert isinstance(backend, RoutedBackend)
    assert backend.masked_backend(cuda, dtype).name == "sdpa"
    assert resolve_backend("auto", CPU, dtype).name == "sdpa"


def test_auto_keeps_the_fused_triton_step_where_no_library_kernel_takes_the_dtype(
        monkeypatch):
    """float32 on CUDA: no library kernel takes it, so ``auto`` stays on Triton's fused ring
    step (a per-piece route could only add launches and merges)."""
    _a_gpu_with_torch_flash(monkeypatch)
    assert resolve_backend("auto", torch.device("cuda"), torch.float32).name == "triton"


def test_a_backend_object_resolves_to_itself_once_checked():
    """``resolve_backend`` takes a backend object too (a caller keeps one routed backend, and
    its measured choices, over many ring calls), checked for support like a name."""
    routed = RoutedBackend()
    assert resolve_backend(routed, CPU, torch.float32) is routed
    with pytest.raises(ValueError, match="'routed' does not support torch.int32 on cpu"):
        resolve_backend(routed, CPU, torch.int32)


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
    assert not isinstance(BACKENDS["routed"](), FusedStepBackend)  # the ring calls it per piece


def test_masked_positions_reach_the_device_through_upload(monkeypatch):
    """A masked piece's positions and document indices (host tensors) go to the device
    through ``common.upload`` (pinned, non-blocking on CUDA), not a pageable ``.to``."""
    uploaded = []
    upload = backends_common.upload

    def spy(tensor, device, dtype=None):
        uploaded.append((tensor, torch.device(device)))
        return upload(tensor, device, dtype)

    monkeypatch.setattr(backends_common, "upload", spy)
    q_pos, k_pos = torch.arange(8) + 4, torch.arange(12)
    q_doc, k_doc = q_pos // 6, k_pos // 6
    allowed = position_mask(q_pos, k_pos, CPU, q_doc=q_doc, k_doc=k_doc)
    assert [id(t) for t, _ in uploaded] == [id(t) for t in (q_pos, k_pos, q_doc, k_doc)]
    assert {device for _, device in uploaded} == {CPU}
    want = (q_pos[:, None] >= k_pos[None, :]) & (q_doc[:, None] == k_doc[None, :])
    assert torch.equal(allowed, want)


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


# The backward signatures of flash-attn 2.5, flash-attn 2.7 and FA3 (hopper/), parameter names
# and defaults as those releases declare them (bodies unused).
def _fa25_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                   causal, window_size, alibi_slopes, deterministic, rng_state=None): ...


def _fa27_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                   causal, window_size_left, window_size_right, softcap, alibi_slopes,
                   deterministic, rng_state=None): ...


def _fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None,
                  sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None,
                  dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
                  window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False,
                  sm_margin=0): ...


def _future_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,
                     new_required_knob): ...


def test_flash_attn_backward_is_called_by_the_names_each_release_uses():
    """The flash-attn/FA3 adapter passes by keyword exactly the parameters a release declares
    that it knows (FA2's ``causal``, FA3's ``is_causal``; FA3's variable-length arguments
    keep their defaults), and refuses a release with a required parameter it does not know,
    naming it (the routed backend's measurement then drops the kernel)."""
    known = dense_module._BACKWARD_PARAMETERS
    tensors = ("dout", "q", "k", "v", "out", "softmax_lse")
    assert dense_module._parameters_known(_fa25_backward, known) == (
        *tensors, "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal", "window_size",
        "alibi_slopes", "deterministic", "rng_state")
    assert "window_size_left" in dense_module._parameters_known(_fa27_backward, known)
    fa3 = dense_module._parameters_known(_fa3_backward, known)
    assert fa3 == (*tensors, "dq", "dk", "dv", "softmax_scale", "is_causal",
                   "window_size_left", "window_size_right", "softcap", "deterministic",
                   "sm_margin")
    with pytest.raises(TypeError, match="parameter 'new_required_knob' is not one this "
                                        "adapter knows"):
        dense_module._parameters_known(_future_backward, known)


DENSE_NAMES = [kernel.name for kernel in library_kernels()]


def _dense_kernel(name: str, dtype: torch.dtype):
    kernel = next(k for k in library_kernels() if k.name == name)
    if not kernel.supports(torch.device("cuda"), dtype):
        pytest.skip(f"{name} does not run on this machine (not built, installed, or GPU too old)")
    return kernel


def _as_ring_views(q, k, v, dout):
    """The tensors laid out as the ring hands them to a kernel: q and dout as rows of a
    (B, S, H, D) block seen as (B, H, S, D), k and v as rows of a contiguous (B, H, S, D)
    buffer, none of them starting at row 0."""
    def rows_of_bshd(t):
        block = torch.zeros(t.shape[0], t.shape[2] + 24, t.shape[1], t.shape[3],
                            dtype=t.dtype, device=t.device)
        block[:, 8:8 + t.shape[2]] = t.transpose(1, 2)
        return block[:, 8:8 + t.shape[2]].transpose(1, 2)

    def rows_of_bhsd(t):
        block = torch.zeros(t.shape[0], t.shape[1], t.shape[2] + 24, t.shape[3],
                            dtype=t.dtype, device=t.device)
        block[:, :, 16:16 + t.shape[2]] = t
        return block[:, :, 16:16 + t.shape[2]]

    return rows_of_bshd(q), rows_of_bhsd(k), rows_of_bhsd(v), rows_of_bshd(dout)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DENSE_NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("layout", ["contiguous", "ring"])
def test_dense_kernel_matches_float64(name, dtype, hkv, layout):
    """Each library kernel's out, LSE (natural log, float32, (B, H, S)) and dq/dk/dv (dk/dv
    at the kv-head count) against float64 math: a FULL rectangle and CAUSAL squares, one of
    a length that is no multiple of the kernels' tiles; MHA and GQA 8:2; contiguous tensors
    and the strided row views the ring passes."""
    kernel = _dense_kernel(name, dtype)
    for kind, q_len, k_len in ((PieceKind.FULL, 200, 136), (PieceKind.CAUSAL, 256, 256),
                               (PieceKind.CAUSAL, 200, 200)):
        q, k, v, dout = (t.cuda() for t in inputs(q_len, k_len, hq=8, hkv=hkv, d=64,
                                                  dtype=dtype))
        if layout == "ring":
            q, k, v, dout = _as_ring_views(q, k, v, dout)
        allowed = allowed_for(kind, torch.arange(q_len), torch.arange(k_len))
        want = math64(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), allowed, 0.125)
        out, lse = kernel.forward(q, k, v, kind=kind, scale=0.125)
        assert lse.dtype == torch.float32 and lse.shape == (2, 8, q_len)
        torch.testing.assert_close(out.double().cpu(), want[0], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double().cpu(), want[1], atol=2e-2, rtol=2e-2)
        grads = kernel.backward(dout, q, k, v, want[0].to(dtype).cuda(), want[1].float().cuda(),
                                kind=kind, scale=0.125)
        assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape),
                                                   tuple(v.shape)]
        for got, ref in zip(grads, want[2:], strict=True):
            torch.testing.assert_close(got.double().cpu(), ref, atol=1e-1, rtol=1e-1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DENSE_NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_kernel_backward_takes_the_ring_final_out_and_lse(name, dtype):
    """The ring's identity: 128 queries over 256 keys as a FULL piece (keys 0..127) and a
    CAUSAL square (keys 128..255), merged by LSE in float32 as the ring merges; each piece's
    backward, given the *merged* out and LSE, adds up to the whole attention's gradients."""
    kernel = _dense_kernel(name, dtype)
    q, k, v, dout = (t.cuda() for t in inputs(128, 256, hq=8, hkv=2, d=64, dtype=dtype))
    halves = (slice(0, 128), slice(128, 256))
    kinds = (PieceKind.FULL, PieceKind.CAUSAL)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    for keys, kind in zip(halves, kinds, strict=True):
        piece_out, piece_lse = kernel.forward(q, k[:, :, keys], v[:, :, keys], kind=kind,
                                              scale=0.125)
        merge_into(out, lse, piece_out, piece_lse)
    allowed = torch.cat([torch.ones(128, 128, dtype=torch.bool),
                         torch.ones(128, 128, dtype=torch.bool).tril()], dim=1)
    want = math64(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), allowed, 0.125)
    torch.testing.assert_close(out.double().cpu(), want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double().cpu(), want[1], atol=2e-2, rtol=2e-2)
    dq, dk, dv = torch.zeros_like(out), torch.zeros(k.shape, device=q.device), \
        torch.zeros(v.shape, device=q.device)
    for keys, kind in zip(halves, kinds, strict=True):
        part = kernel.backward(dout, q, k[:, :, keys], v[:, :, keys], out.to(dtype), lse,
                               kind=kind, scale=0.125)
        dq += part[0]
        dk[:, :, keys] += part[1]
        dv[:, :, keys] += part[2]
    for got, ref in zip((dq, dk, dv), want[2:], strict=True):
        torch.testing.assert_close(got.double().cpu(), ref, atol=1e-1, rtol=1e-1)


@pytest.mark.gpu
def test_sdpa_masked_piece_on_cuda_waits_for_no_host_copy():
    """A masked SDPA piece whose positions and document indices are host tensors (as the
    ring passes them) makes no synchronising host-to-device copy: under
    ``torch.cuda.set_sync_debug_mode("error")`` a pageable ``.to(device)`` raises."""
    backend = BACKENDS["sdpa"]()
    q, k, v, dout = (t.cuda() for t in inputs(64, 80, hq=8, hkv=2, d=64, dtype=torch.bfloat16))
    q_pos, k_pos = torch.arange(64) + 40, torch.arange(80)
    mask = {"q_pos": q_pos, "k_pos": k_pos, "q_doc": q_pos // 50, "k_doc": k_pos // 50}
    out, lse = backend.forward(q, k, v, kind=PieceKind.MASKED, scale=0.125, **mask)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = backend.forward(q, k, v, kind=PieceKind.MASKED, scale=0.125, **mask)
        backend.backward(dout, q, k, v, out, lse, kind=PieceKind.MASKED, scale=0.125, **mask)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
