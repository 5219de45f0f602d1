"""Per-rank workers for the multi-process ring-attention tests (importable by spawned ranks).

Every rank builds the same global q/k/v from a seed, computes the references itself on the
unsharded sequence (PyTorch SDPA in the input dtype, and the same in float64), runs
``ring_attention`` on its shard, and compares its shard of output, LSE and gradients.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ringray.attention import Layout, make_layout, ring_attention

BATCH = 2
# (q_heads, kv_heads, head_dim)
HEADS = {
    "mha": (8, 8, 32),
    "gqa": (8, 2, 32),
    "mqa": (8, 1, 32),
    "odd": (5, 5, 80),
    "odd-mqa": (5, 1, 80),
}
SEED_FOLD = [[0, 7, 8, 15], [1, 6, 9, 14], [2, 5, 10, 13], [3, 4, 11, 12]]
F32_TOL = 1e-5
# bfloat16: the allowed error is this factor times SDPA's own bf16 error against float64.
# CPU SDPA keeps P and dS in float32; the triton kernels round them to bf16 before their
# products, as GPU flash kernels do, which costs more on dQ (measured on CPU under the
# interpreter: up to 2.6x SDPA's error), so triton gets 4x.
BF16_ERROR_FACTOR = {"auto": 2.0, "triton": 4.0}


@dataclass(frozen=True)
class Case:
    layout: str  # contiguous | zigzag | striped | random | fold
    heads: str
    dtype: str
    causal: bool
    seq: int
    backend: str = "auto"

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        suffix = "" if self.backend == "auto" else f"-{self.backend}"
        return f"{self.layout}-{self.heads}-{self.dtype}-{mask}-s{self.seq}{suffix}"


def random_permutation_layout(world_size: int, per_rank: int, rnd) -> Layout:
    """A layout holding a shuffled permutation of ``world_size * per_rank`` tokens."""
    seq = world_size * per_rank
    perm = list(range(seq))
    rnd.shuffle(perm)
    return make_layout([perm[r * per_rank:(r + 1) * per_rank] for r in range(world_size)],
                       world_size, seq)


def layout_for(case: Case, world_size: int):
    if case.layout == "fold":
        return SEED_FOLD
    if case.layout == "random":
        g = torch.Generator().manual_seed(1234 + world_size)
        return torch.randperm(case.seq, generator=g).view(world_size, -1).tolist()
    return case.layout


def global_inputs(case: Case):
    """Float64 q, k, v and upstream gradient; the seed depends on the case, not the ring."""
    q_heads, kv_heads, head_dim = HEADS[case.heads]
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.heads}-{case.seq}".encode()))
    q = torch.randn(BATCH, case.seq, q_heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(BATCH, case.seq, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, case.seq, kv_heads, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(BATCH, case.seq, q_heads, head_dim, generator=g, dtype=torch.float64)
    return q, k, v, dout


def sdpa_reference(q, k, v, dout, causal):
    """PyTorch SDPA on the whole sequence: output and dq/dk/dv, in the inputs' dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=causal, enable_gqa=True,
    ).transpose(1, 2)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def lse_reference(q, k, causal):
    """Natural-log LSE in float64 math: ``(batch, q_heads, seq)``."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * q.shape[-1] ** -0.5
    if causal:
        seq = q.shape[1]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -torch.inf)
    return torch.logsumexp(scores, dim=-1)


def run_case(rank: int, world_size: int, case: Case) -> dict:
    """Run one case on this rank; raise on a failed check, else return its squared errors
    against float64 per tensor (so that the caller can form the global RMS error)."""
    dtype = getattr(torch, case.dtype)
    q64, k64, v64, dout64 = global_inputs(case)
    q_in, k_in, v_in, dout_in = (t.to(dtype) for t in (q64, k64, v64, dout64))
    ref = sdpa_reference(q_in, k_in, v_in, dout_in, case.causal)
    exact = sdpa_reference(q_in.double(), k_in.double(), v_in.double(), dout_in.double(),
                           case.causal)
    lse_exact = lse_reference(q_in, k_in, case.causal)

    layout = make_layout(layout_for(case, world_size), world_size, case.seq)
    q, k, v = (layout.shard(t, rank).requires_grad_() for t in (q_in, k_in, v_in))
    out, lse = ring_attention(q, k, v, layout=layout, causal=case.causal, return_lse=True,
                              backend=case.backend)
    out.backward(layout.shard(dout_in, rank))
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    errors = {}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        mine = got[name]
        ref_shard = layout.shard(ref[i], rank)
        exact_shard = layout.shard(exact[i], rank)
        assert torch.isfinite(mine).all(), f"{name} has NaN/inf"
        assert mine.dtype == dtype, f"{name} dtype {mine.dtype}"
        errors[name] = _squared_error(mine, exact_shard)
        if dtype == torch.float32:
            torch.testing.assert_close(mine, ref_shard, atol=F32_TOL, rtol=F32_TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:
            # SDPA's own error against float64, times a factor, is the allowed error.
            sdpa_error = (ref_shard.double() - exact_shard).abs().max().item()
            allowed = BF16_ERROR_FACTOR[case.backend] * sdpa_error
            torch.testing.assert_close(mine.double(), exact_shard, atol=allowed, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
    lse_shard = layout.shard(lse_exact, rank, dim=2)
    torch.testing.assert_close(lse.double(), lse_shard, atol=F32_TOL, rtol=F32_TOL)
    errors["lse"] = _squared_error(lse, lse_shard)
    return errors


def _squared_error(mine: torch.Tensor, exact: torch.Tensor) -> tuple[float, int]:
    """(sum of squared errors, element count) against float64, for a global RMS error."""
    return (mine.double() - exact).pow(2).sum().item(), exact.numel()


def run_cases(rank: int, world_size: int, cases: list[dict]) -> dict[str, dict]:
    """Run many cases in one process group; each case's outcome is reported separately."""
    import traceback

    outcome = {}
    for fields in cases:
        case = Case(**fields)
        try:
            outcome[case.id] = {"ok": True, "errors": run_case(rank, world_size, case)}
        except Exception:  # noqa: BLE001 - one case's failure must not hide the others
            outcome[case.id] = {"ok": False, "error": traceback.format_exc()}
    return outcome


def case_matrix(world_size: int, seq: int) -> list[Case]:
    cases = [
        Case(layout, heads, dtype, causal, seq)
        for layout in ("contiguous", "zigzag", "striped", "random")
        for heads in HEADS
        for dtype in ("float32", "bfloat16")
        for causal in (True, False)
    ]
    if world_size == 4:
        cases += [
            Case("fold", heads, dtype, causal, 16)
            for heads in HEADS
            for dtype in ("float32", "bfloat16")
            for causal in (True, False)
        ]
    return cases


def as_payload(cases: list[Case]) -> list[dict]:
    return [asdict(c) for c in cases]
