"""The routed backend and the measured choice behind ``auto`` (issue 41).

- :class:`KernelChoices` times real CPU kernels (SDPA against the materialised-score
  reference, float32) and keeps the faster; a second piece of the same shape class is not
  timed again, a piece of another class is; a single candidate is never timed; a candidate
  that raises is dropped; choices persist in a JSON file across instances, and an unreadable
  or unwritable file only means measuring.
- :class:`RoutedBackend` sends FULL pieces and CAUSAL squares to the chosen dense kernel and
  MASKED pieces (and causal rectangles) to the masked backend, with exact results; spies
  count the calls of real backends.
- Through the real ring on gloo process groups (2 and 3 ranks), with packed documents,
  causal and full, regular and irregular layouts: a routed backend whose dense candidates are
  SDPA and the reference (measured inside the ring) and whose masked backend is Triton
  (its interpreter on CPU) equals float64 attention with the documents' mask. Tolerances as
  in ``tests/doc_cases.py``: float32 within 1e-5 of float64; bfloat16 within
  ``BF16_ERROR_FACTOR["triton"]`` (4) times PyTorch SDPA's own bfloat16 error; LSE 1e-5.

GPU-only checks (marked ``gpu``): ``auto`` on CUDA resolves to the routed backend, measures,
writes its file, and is exact through the ring.
"""

from __future__ import annotations

import json
import traceback
from collections import Counter
from dataclasses import asdict, dataclass

import doc_cases as dc
import pytest
import torch
from distributed import run_gloo_ranks
from ring_cases import BF16_ERROR_FACTOR, F32_TOL
from test_backends import allowed_for, inputs, math64

from ringray.attention import ring_attention
from ringray.attention.backends import resolve_backend
from ringray.attention.backends.dense import CudnnKernel, WholeBackendKernel
from ringray.attention.backends.reference import ReferenceBackend
from ringray.attention.backends.routed import KernelChoices, RoutedBackend, ShapeClass
from ringray.attention.backends.sdpa import SdpaBackend
from ringray.attention.pieces import PieceKind

CPU = torch.device("cpu")


class Spy:
    """A real kernel or backend, its calls counted by (direction, piece kind); results are
    the wrapped object's own. ``fail``: raise instead, as a kernel that cannot run here."""

    def __init__(self, inner, *, fail: str | None = None) -> None:
        self.inner, self.name, self.fail = inner, inner.name, fail
        self.calls: Counter = Counter()

    def supports(self, device, dtype):
        return self.inner.supports(device, dtype)

    def supports_head_dim(self, head_dim):
        return getattr(self.inner, "supports_head_dim", lambda _: True)(head_dim)

    def forward(self, q, k, v, *, kind, scale, **mask):
        self.calls["forward", kind] += 1
        if self.fail:
            raise RuntimeError(self.fail)
        return self.inner.forward(q, k, v, kind=kind, scale=scale, **mask)

    def backward(self, dout, q, k, v, out, lse, *, kind, scale, **mask):
        self.calls["backward", kind] += 1
        return self.inner.backward(dout, q, k, v, out, lse, kind=kind, scale=scale, **mask)

    def total(self) -> int:
        return sum(self.calls.values())


def sdpa_kernel() -> Spy:
    return Spy(WholeBackendKernel(SdpaBackend()))


def reference_kernel() -> Spy:
    return Spy(WholeBackendKernel(ReferenceBackend()))


def piece(q_len, k_len, *, hq=4, hkv=2, d=64, dtype=torch.float32):
    q, k, _, _ = inputs(q_len, k_len, hq=hq, hkv=hkv, d=d, dtype=dtype)
    return q, k


def test_the_faster_kernel_is_kept():
    """SDPA (a fused CPU kernel) against the reference (materialised scores) on a 512 x 512
    float32 FULL piece: SDPA was 4x faster on this project's CPU machine; the chooser times
    both (one warm-up and three timed runs each) and keeps SDPA, whichever comes first."""
    reference, sdpa = reference_kernel(), sdpa_kernel()
    choices = KernelChoices()
    q, k = piece(512, 512)
    chosen = choices.choose([reference, sdpa], q, k, PieceKind.FULL, 0.125)
    assert chosen is sdpa, choices.seconds
    assert choices.measured == 1
    assert reference.calls["forward", PieceKind.FULL] == 4
    assert sdpa.calls["backward", PieceKind.FULL] == 4
    (seconds,) = choices.seconds.values()
    assert seconds["sdpa"] < seconds["reference"]


def test_a_shape_class_is_measured_once():
    """Pieces of 300 and 400 rows fall in one class (longer side up to 512): the second is
    answered from the first's measurement, no candidate runs again."""
    candidates = [reference_kernel(), sdpa_kernel()]
    choices = KernelChoices(repeats=1, warmup=0)
    first = choices.choose(candidates, *piece(300, 300), PieceKind.FULL, 0.125)
    runs = [c.total() for c in candidates]
    assert runs == [2, 2] and choices.measured == 1  # one forward and one backward each
    again = choices.choose(candidates, *piece(400, 260), PieceKind.FULL, 0.125)
    assert again is first
    assert [c.total() for c in candidates] == runs and choices.measured == 1
    assert list(choices.chosen()) == [ShapeClass("cpu", "float32", 64, 2, "full", 512)]


@pytest.mark.parametrize("other", ["kind", "length", "head_dim", "group", "dtype"])
def test_another_shape_class_is_measured_again(other):
    """Each field of the class makes its own measurement: the piece kind, the length bucket,
    the head dim, the query heads per K/V head and the dtype."""
    candidates = [reference_kernel(), sdpa_kernel()]
    choices = KernelChoices(repeats=1, warmup=0)
    choices.choose(candidates, *piece(64, 64), PieceKind.FULL, 0.125)
    kind, shape = PieceKind.FULL, {}
    if other == "kind":
        kind = PieceKind.CAUSAL
    elif other == "length":
        shape = {"q_len": 65, "k_len": 65}
    else:
        shape = {"head_dim": {"d": 32}, "group": {"hkv": 4},
                 "dtype": {"dtype": torch.float64}}[other]
    lengths = (shape.pop("q_len", 64), shape.pop("k_len", 64))
    choices.choose(candidates, *piece(*lengths, **shape), kind, 0.125)
    assert choices.measured == 2
    assert [c.total() for c in candidates] == [4, 4]


def test_a_single_candidate_is_not_measured():
    """cuDNN does not run on CPU, which leaves SDPA alone: chosen without a run. With no
    candidate left the answer is None (the routed backend then uses its masked backend)."""
    sdpa = sdpa_kernel()
    choices = KernelChoices()
    assert choices.choose([CudnnKernel(), sdpa], *piece(64, 64), PieceKind.FULL, 0.1) is sdpa
    assert choices.choose([CudnnKernel()], *piece(64, 64), PieceKind.CAUSAL, 0.1) is None
    assert sdpa.total() == 0 and choices.measured == 0


def test_a_kernel_that_raises_is_dropped():
    """A candidate that raises when timed (a library built for another GPU) is not chosen,
    and the reason is kept."""
    broken = Spy(WholeBackendKernel(ReferenceBackend()), fail="no kernel image for sm_00")
    sdpa = sdpa_kernel()
    choices = KernelChoices(repeats=1, warmup=0)
    assert choices.choose([broken, sdpa], *piece(64, 64), PieceKind.FULL, 0.1) is sdpa
    assert choices.failures == {"reference": "RuntimeError: no kernel image for sm_00"}


def test_choices_persist_in_the_file(tmp_path):
    """A second instance on the same file (a restarted job, another rank) reads the choice
    and measures nothing; the file names torch's version and the candidates."""
    path = tmp_path / "cache" / "kernel-choices.json"
    first = KernelChoices(path=path, repeats=1, warmup=0)
    chosen = first.choose([reference_kernel(), sdpa_kernel()], *piece(128, 128),
                          PieceKind.CAUSAL, 0.125)
    stored = json.loads(path.read_text())
    assert stored["format"] == 1
    (key,) = stored["choices"]
    assert key == f"torch {torch.__version__}; reference sdpa"
    assert stored["choices"][key] == {"cpu|float32|d64|g2|causal|128": chosen.name}

    candidates = [reference_kernel(), sdpa_kernel()]
    second = KernelChoices(path=path)
    again = second.choose(candidates, *piece(100, 100), PieceKind.CAUSAL, 0.125)
    assert again.name == chosen.name
    assert second.measured == 0 and [c.total() for c in candidates] == [0, 0]


@pytest.mark.parametrize("bad", ["corrupt", "a directory"])
def test_a_bad_file_only_means_measuring(tmp_path, bad):
    """An unreadable file (not JSON) is measured over and rewritten; an unwritable one (a
    directory in its place) leaves the choice in memory. Neither raises."""
    path = tmp_path / "kernel-choices.json"
    if bad == "corrupt":
        path.write_text("{not json")
    else:
        path.mkdir()
    choices = KernelChoices(path=path, repeats=1, warmup=0)
    chosen = choices.choose([reference_kernel(), sdpa_kernel()], *piece(64, 64),
                            PieceKind.FULL, 0.1)
    assert chosen is not None and choices.measured == 1
    if bad == "corrupt":
        assert json.loads(path.read_text())["format"] == 1


def test_routing_sends_each_piece_where_it_belongs():
    """FULL pieces and CAUSAL squares to the dense kernel; MASKED pieces and a causal
    rectangle to the masked backend; every result equal to float64 math, forward and
    backward."""
    dense, masked = sdpa_kernel(), Spy(ReferenceBackend())
    routed = RoutedBackend([dense], masked)
    pos = torch.arange(40)
    cases = [(PieceKind.FULL, 24, 40, {}), (PieceKind.CAUSAL, 40, 40, {}),
             (PieceKind.CAUSAL, 24, 40, {}),
             (PieceKind.MASKED, 24, 40, {"q_pos": pos[:24] + 9, "k_pos": pos})]
    for kind, q_len, k_len, mask in cases:
        q, k, v, dout = inputs(q_len, k_len)
        out, lse = routed.forward(q, k, v, kind=kind, scale=0.3, **mask)
        allowed = (allowed_for(kind, mask["q_pos"], mask["k_pos"]) if mask
                   else torch.ones(q_len, k_len, dtype=torch.bool).tril()
                   if kind is PieceKind.CAUSAL else allowed_for(kind, pos[:q_len], pos))
        want = math64(q, k, v, dout, allowed, 0.3)
        torch.testing.assert_close(out.double(), want[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), want[1], atol=2e-5, rtol=2e-5)
        grads = routed.backward(dout, q, k, v, want[0].float(), want[1].float(), kind=kind,
                                scale=0.3, **mask)
        for got, ref in zip(grads, want[2:], strict=True):
            torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)
    assert dense.calls == Counter({("forward", PieceKind.FULL): 1,
                                   ("backward", PieceKind.FULL): 1,
                                   ("forward", PieceKind.CAUSAL): 1,
                                   ("backward", PieceKind.CAUSAL): 1})
    assert masked.calls == Counter({("forward", PieceKind.CAUSAL): 1,
                                    ("backward", PieceKind.CAUSAL): 1,
                                    ("forward", PieceKind.MASKED): 1,
                                    ("backward", PieceKind.MASKED): 1})


def test_without_a_dense_kernel_every_piece_goes_to_the_masked_backend():
    """cuDNN alone as the dense candidate, on CPU: no dense kernel runs, so FULL and CAUSAL
    go to the masked backend too. The default routed backend on CPU: SDPA for both."""
    masked = Spy(SdpaBackend())
    routed = RoutedBackend([CudnnKernel()], masked)
    q, k, v, _ = inputs(32, 32)
    routed.forward(q, k, v, kind=PieceKind.FULL, scale=0.2)
    routed.forward(q, k, v, kind=PieceKind.CAUSAL, scale=0.2)
    assert masked.total() == 2
    default = RoutedBackend()
    assert [k.name for k in default.dense_kernels(CPU)] == ["sdpa"]
    assert default.masked_backend(CPU, torch.float32).name == "sdpa"
    assert default.supports(CPU, torch.float64) and not default.supports(CPU, torch.int32)


# ----------------------------------------------------------------------------------------
# Through the real ring: gloo process groups, documents, dense SDPA/reference, masked Triton.

@dataclass(frozen=True)
class RingCase:
    layout: str
    documents: str  # a tests/doc_cases.py document set
    dtype: str
    causal: bool
    dense: bool  # whether the plan has FULL or CAUSAL pieces
    masked: bool  # whether it has MASKED ones (an irregular layout, tiles across documents)

    @property
    def id(self) -> str:
        return (f"{self.layout}-{self.documents}-{self.dtype}-"
                f"{'causal' if self.causal else 'full'}")


HEADS = "gqa-small"  # (4, 2, 16): Triton's interpreter costs about 5 ms per program
RING_CASES = {
    2: [RingCase("zigzag", "mixed", "float32", True, dense=True, masked=False),
        RingCase("balanced", "one-heavy", "float32", True, dense=True, masked=True),
        RingCase("whole", "long-tail", "bfloat16", True, dense=True, masked=True),
        RingCase("zigzag", "short", "float32", False, dense=True, masked=True),
        RingCase("random", "mixed", "float32", True, dense=False, masked=True)],
    3: [RingCase("zigzag", "tiny", "float32", True, dense=True, masked=True),
        RingCase("random", "edge", "bfloat16", False, dense=True, masked=True)],
}


def run_ring_case(rank: int, world: int, case: RingCase) -> dict[str, int]:
    """One case on this rank through ``ring_attention`` with a routed backend object;
    raises on a failed check, else returns its calls: dense by kind, masked by kind."""
    from ringray.attention.backends.triton import TritonBackend

    dtype = getattr(torch, case.dtype)
    documents = dc.documents_named(case.documents)
    q_in, k_in, v_in, dout_in = dc.global_inputs(HEADS, f"routed-{case.documents}", dtype,
                                                 sum(documents))
    mask = dc.document_mask(documents, case.causal)
    exact = dc.masked_attention(q_in, k_in, v_in, dout_in, mask, torch.float64)
    sdpa = (dc.masked_attention(q_in, k_in, v_in, dout_in, mask, dtype)
            if dtype != torch.float32 else None)
    dense = [sdpa_kernel(), reference_kernel()]
    masked = Spy(TritonBackend())
    routed = RoutedBackend(dense, masked, choices=KernelChoices(repeats=1, warmup=0))

    layout = dc.layout_for(case.layout, world, documents)
    q, k, v = (layout.shard(t, rank).requires_grad_() for t in (q_in, k_in, v_in))
    out, lse = ring_attention(q, k, v, layout=layout, causal=case.causal, return_lse=True,
                              backend=routed, documents=documents)
    out.backward(layout.shard(dout_in, rank))
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        mine, want = got[name], layout.shard(exact[i], rank)
        assert torch.isfinite(mine).all(), f"{name} has NaN/inf"
        assert mine.dtype == dtype, f"{name} dtype {mine.dtype}"
        if sdpa is None:
            tolerance = {"atol": F32_TOL, "rtol": F32_TOL}
        else:
            sdpa_error = (layout.shard(sdpa[i], rank).double() - want).abs().max().item()
            tolerance = {"atol": BF16_ERROR_FACTOR["triton"] * sdpa_error, "rtol": 0}
        torch.testing.assert_close(mine.double(), want, **tolerance,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(lse.double(), layout.shard(exact[1], rank, dim=2),
                               atol=F32_TOL, rtol=F32_TOL)
    calls = Counter()
    for kernel in dense:
        for (_, kind), n in kernel.calls.items():
            calls[f"dense-{kind.value}"] += n
    for (_, kind), n in masked.calls.items():
        calls[f"masked-{kind.value}"] += n
    return dict(calls)


def run_ring_cases(rank: int, world: int, cases: list[dict]) -> dict[str, dict]:
    outcome = {}
    for fields in cases:
        case = RingCase(**fields)
        try:
            outcome[case.id] = {"error": None, "calls": run_ring_case(rank, world, case)}
        except Exception:  # noqa: BLE001 - one case's failure must not hide the others
            outcome[case.id] = {"error": traceback.format_exc()}
    return outcome


_ring_results: dict[int, list[dict]] = {}


def ring_results(world: int) -> list[dict]:
    if world not in _ring_results:
        _ring_results[world] = run_gloo_ranks(
            world, run_ring_cases, [asdict(c) for c in RING_CASES[world]], timeout_seconds=300)
    return _ring_results[world]


@pytest.mark.parametrize(
    "world,case", [pytest.param(w, c, id=f"n{w}-{c.id}") for w, cs in RING_CASES.items()
                   for c in cs])
def test_routed_ring_matches_float64(world, case):
    """Exact on every rank, forward and backward; the dense kernels got the plan's FULL and
    CAUSAL pieces and nothing else, Triton its MASKED pieces and nothing else."""
    pytest.importorskip("triton")
    from ringray.attention.backends.triton_common import kernels_interpreted

    if not kernels_interpreted():  # conftest.py sets TRITON_INTERPRET=1 only without a GPU
        pytest.skip("the masked backend here is Triton on CPU, which needs its interpreter")
    outcomes = [ranks[case.id] for ranks in ring_results(world)]
    failures = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outcomes) if o["error"]]
    assert not failures, "\n".join(failures)
    calls = sum((Counter(o["calls"]) for o in outcomes), Counter())
    assert (calls["dense-full"] + calls["dense-causal"] > 0) == case.dense, calls
    assert (calls["masked-masked"] > 0) == case.masked, calls
    assert calls["dense-masked"] == calls["masked-full"] == calls["masked-causal"] == 0, calls


# ----------------------------------------------------------------------------------------
# On a GPU: auto is the routed backend, measures once per class, and is exact in the ring.

@pytest.mark.gpu
def test_auto_on_cuda_routes_measures_once_and_is_exact(tmp_path):
    """bfloat16 on CUDA: ``auto`` resolves to the routed backend (a library kernel runs
    there). Through a one-rank ring with documents, a routed backend with its file under
    ``tmp_path`` measures its classes, writes them, and matches float64 within 4x SDPA's own
    bfloat16 error; a second instance on the same file measures nothing."""
    cuda = torch.device("cuda")
    assert isinstance(resolve_backend("auto", cuda, torch.bfloat16), RoutedBackend)
    documents = [100, 156, 64, 192]
    mask = dc.document_mask(documents, True)
    q_in, k_in, v_in, dout_in = dc.global_inputs("gqa", "routed-cuda", torch.bfloat16, 512)
    exact = dc.masked_attention(q_in, k_in, v_in, dout_in, mask, torch.float64)
    sdpa = dc.masked_attention(q_in, k_in, v_in, dout_in, mask, torch.bfloat16)
    path = tmp_path / "kernel-choices.json"
    for attempt in range(2):
        routed = RoutedBackend(choices=KernelChoices(path=path))
        q, k, v = (t.cuda().requires_grad_() for t in (q_in, k_in, v_in))
        out = ring_attention(q, k, v, causal=True, documents=documents, backend=routed)
        out.backward(dout_in.cuda())
        for got, i in ((out.detach(), 0), (q.grad, 2), (k.grad, 3), (v.grad, 4)):
            want = exact[i]
            allowed = 4 * (sdpa[i].double() - want).abs().max().item()
            torch.testing.assert_close(got.double().cpu(), want, atol=allowed, rtol=0)
        chosen = routed.choices.chosen()
        assert chosen and all(name is not None for name in chosen.values()), chosen
        if attempt == 0:
            assert routed.choices.measured >= 1, routed.choices.failures
        else:
            assert routed.choices.measured == 0  # read from the file the first one wrote
    assert json.loads(path.read_text())["choices"]
