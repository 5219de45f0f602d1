"""A ring step's posting waits only for what its messages need, never for the previous step's
compute, and a receive buffer is reused only after the compute that last used it.

On CUDA a step is posted from a side stream (:class:`~ringray.attention.comm.
CudaStepScheduler`) that waits for marks (CUDA events) instead of the whole compute stream.
Here the same ring code runs on real gloo rings of 4 processes with a recording scheduler in
its place: it keeps the scheduler's rules (which buffer a receive may reuse, where a mark is
made) but, instead of streams, logs every mark, every wait and every exchange. From that
dependency graph, for every posting of every rank, forward and backward, zigzag (whole blocks),
packed documents (partial transfers, gathered rows, the own block spread over the steps) and a
sliding window:

- a posting that sends the own block's rows waits for the own-block mark;
- one that sends a dK/dV sum back waits for that sum's mark;
- one that receives into a buffer used before waits for the buffer's latest give-back mark,
  made after the buffer last travelled;
- it waits for no other mark made since the previous posting began: nothing of the previous
  step's compute (receives run a step ahead: the give-back marks it waits for are older);
- and the results are bit for bit those of the no-op scheduler (CPU's, today's order).

The ``gpu`` tests check the CUDA scheduler itself: that a side-stream posting runs while the
compute stream is still busy, and the same graph for a ring rank on CUDA over PyTorch's
``fake`` backend (one GPU holds one NCCL rank).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
from distributed import run_gloo_ranks

from ringray.attention.comm import (
    NULL_SCHEDULER,
    CudaStepScheduler,
    MarkingScheduler,
    PendingExchange,
    RingComm,
    StepScheduler,
    StreamMark,
)

WORLD = 4
KV_TAG, DKV_TAG = 0, 1  # ring.py's message tags
# name: (layout, document lengths or None, causal, window)
CASES = {
    "zigzag-causal": ("zigzag", None, True, None),
    "balanced-documents": ("balanced", [1, 37, 2, 45, 1, 7, 27, 8], True, None),
    "zigzag-documents-full": ("zigzag", [30, 50, 11, 37], False, None),
    "striped-window": ("striped", None, True, 24),
}
SEQ = 128


def _storage(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.untyped_storage().data_ptr()


@dataclass(frozen=True)
class _Token:
    """A recorded mark's event: its number in the log, and the recorded scheduler's own."""

    id: int
    event: object


class Recording:
    """Logs a marking scheduler's marks, waits, allocations and exchanges (plain dicts, one
    list per ring phase) and passes them on. Mixed in before the scheduler it records."""

    def __init__(self, log: list[dict], ids: Iterator[int], *args: object) -> None:
        super().__init__(*args)
        self.log, self._ids = log, ids

    def _record(self, on_side: bool, label: str, tensor: torch.Tensor | None) -> object:
        token = _Token(next(self._ids), super()._record(on_side, label, tensor))
        self.log.append({"kind": "mark", "id": token.id, "label": label, "on_side": on_side,
                         "posting": self.postings, "storage": _storage(tensor)})
        return token

    def _wait(self, on_side: bool, mark: StreamMark) -> None:
        self.log.append({"kind": "wait", "on_side": on_side, "mark": mark.event.id,
                         "posting": self.postings})
        super()._wait(on_side, replace(mark, event=mark.event.event))

    def _made(self, tensor: torch.Tensor) -> None:
        self.log.append({"kind": "made", "posting": self.postings,
                         "storage": _storage(tensor)})
        super()._made(tensor)

    def _exchange(self, comm: RingComm, send, recv) -> PendingExchange:
        self.log.append({"kind": "exchange", "posting": self.postings,
                         "send": [(tag, peer, _storage(t)) for t, peer, tag in send],
                         "recv": [(tag, peer, _storage(t)) for t, peer, tag in recv]})
        return super()._exchange(comm, send, recv)


class _Streamless(MarkingScheduler):
    """The marking rules with nothing behind them (no streams on CPU)."""

    def _record(self, on_side: bool, label: str, tensor: torch.Tensor | None) -> object:
        return None

    def _wait(self, on_side: bool, mark: StreamMark) -> None:
        pass


class RecordingScheduler(Recording, _Streamless):
    pass


def _recorded(make, logs: list[list[dict]]):
    """A ``step_scheduler`` replacement: each phase gets ``make(log, ids, device)``."""
    ids = itertools.count()

    def factory(device: torch.device) -> StepScheduler:
        log: list[dict] = []
        logs.append(log)
        return make(log, ids, device)
    return factory


def _inputs(case: str, world: int, rank: int, device: torch.device):
    from ringray.attention import make_layout

    kind, documents, _, _ = CASES[case]
    layout = make_layout(kind, world, SEQ, documents=documents)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, SEQ, 4, 16, generator=g)
    k, v, dout = (torch.randn(2, SEQ, h, 16, generator=g) for h in (2, 2, 4))
    return layout, [layout.shard(t, rank).to(device) for t in (q, k, v, dout)]


def _run(case: str, world: int, rank: int, device: torch.device, factory) -> list:
    """One forward and backward of ``case`` with ``factory`` as the ring's scheduler."""
    import ringray.attention.ring as ring

    layout, (q, k, v, dout) = _inputs(case, world, rank, device)
    _, documents, causal, window = CASES[case]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    saved = ring.step_scheduler
    ring.step_scheduler = factory
    try:
        out = ring.ring_attention(q, k, v, layout=layout, causal=causal, backend="sdpa",
                                  documents=documents, window=window)
        out.backward(dout)
    finally:
        ring.step_scheduler = saved
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


def _rank_graphs(rank: int, world: int) -> dict:
    """Per case: the recorded forward and backward logs, and whether the results equal the
    no-op scheduler's bit for bit."""
    device = torch.device("cpu")
    result = {}
    for case in CASES:
        plain = _run(case, world, rank, device, lambda _device: NULL_SCHEDULER)
        logs: list[list[dict]] = []
        recorded = _run(case, world, rank, device, _recorded(
            lambda log, ids, _device: RecordingScheduler(log, ids), logs))
        result[case] = {"logs": logs,
                        "equal": [torch.equal(a, b) for a, b in zip(plain, recorded,
                                                                     strict=True)]}
    return result


def dependency_violations(phase_log: list[dict], marks: dict[int, dict]) -> list[str]:
    """What breaks the posting rules in one phase's log (``marks``: every mark of the call,
    by id, the forward's own-block mark included). Empty when all hold."""
    problems = []
    seen_at: dict[int, int] = {}  # storage -> log index of its last exchange
    born_at: dict[int, int] = {}  # storage -> log index where a posting allocated it
    for index, entry in enumerate(phase_log):
        if entry["kind"] == "made":  # new memory: what its address held before is no matter
            seen_at.pop(entry["storage"], None)
            born_at[entry["storage"]] = index
        if entry["kind"] != "exchange":
            continue
        posting = entry["posting"]
        waited = {w["mark"] for w in phase_log[:index]
                  if w["kind"] == "wait" and w["on_side"] and w["posting"] == posting}
        labels = {marks[m]["label"] for m in waited}
        returned = {f"sum {peer}" for tag, peer, _ in entry["send"] if tag == DKV_TAG}
        where = f"posting {posting}"
        if any(tag == KV_TAG for tag, _, _ in entry["send"]) and "own" not in labels:
            problems.append(f"{where}: sends own K/V rows without waiting for the own block")
        for label in returned - labels:
            problems.append(f"{where}: returns a dK/dV sum without waiting for {label!r}")
        for m in waited:
            mark = marks[m]
            if mark["on_side"]:
                problems.append(f"{where}: waits on a side-stream mark ({mark['label']})")
            elif (mark["label"] != "own" and mark["label"] not in returned
                  and mark["posting"] > posting - 2):
                problems.append(f"{where}: waits on {mark['label']!r} made since the "
                                f"previous posting began (the previous step's compute)")
        for _, _, storage in entry["recv"]:
            frees = [(i, e) for i, e in enumerate(phase_log[:index])
                     if e["kind"] == "mark" and e["label"] == "free" and e["storage"] == storage
                     and i > born_at.get(storage, -1)]
            used_before = storage in seen_at or frees
            if not used_before:
                continue
            if not frees or frees[-1][0] < seen_at.get(storage, -1):
                problems.append(f"{where}: receives into a buffer not given back since it "
                                f"last travelled")
                continue
            latest = frees[-1][1]
            if not latest["on_side"] and latest["id"] not in waited:
                problems.append(f"{where}: receives into a buffer without waiting for its "
                                f"give-back mark")
        for _, _, storage in entry["send"] + entry["recv"]:
            seen_at[storage] = index
    return problems


@pytest.fixture(scope="module")
def graphs() -> list[dict]:
    return run_gloo_ranks(WORLD, _rank_graphs, timeout_seconds=300)


@pytest.mark.parametrize("case", list(CASES))
def test_postings_wait_only_for_own_block_sums_and_free_buffers(graphs, case) -> None:
    problems = []
    for rank, result in enumerate(graphs):
        logs = result[case]["logs"]
        assert len(logs) == 2, f"rank {rank}: {len(logs)} phases recorded (forward, backward)"
        marks = {e["id"]: e for log in logs for e in log if e["kind"] == "mark"}
        for phase, log in zip(("forward", "backward"), logs, strict=True):
            problems += [f"rank {rank} {phase} {p}"
                         for p in dependency_violations(log, marks)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", list(CASES))
def test_results_are_those_of_the_no_op_scheduler(graphs, case) -> None:
    for rank, result in enumerate(graphs):
        assert result[case]["equal"] == [True] * 4, (rank, "out, dq, dk, dv")


def test_the_cases_cover_reuse_gathers_and_returned_sums(graphs) -> None:
    """The rules above are exercised: receives into reused buffers (a give-back mark waited
    for), rows gathered in a posting, sums returned after a gather (given back on the side
    stream) and whole."""
    entries = [e for result in graphs for case in result.values() for log in case["logs"]
               for e in log]
    marks = {e["id"]: e for e in entries if e["kind"] == "mark"}
    waited_labels = [marks[e["mark"]]["label"] for e in entries if e["kind"] == "wait"]
    assert waited_labels.count("free") > 0
    assert any(e["kind"] == "made" for e in entries)
    assert any(e["label"] == "free" and e["on_side"] for e in marks.values())
    assert any(label.startswith("sum ") for label in waited_labels)


def test_a_buffer_is_reused_by_a_receive_only_two_postings_after_its_give_back() -> None:
    """The reuse rule alone: made on the compute stream since the previous posting began, a
    give-back mark keeps its buffer from a receive; older, or on the side stream, it does
    not; the no-op scheduler reuses anything."""
    scheduler = _Streamless()
    with scheduler.posting():
        pass
    fresh = scheduler.mark("free")  # during the first posting's step
    with scheduler.posting() as post:
        side = post.mark("free")
        assert not scheduler.reusable(fresh) and scheduler.reusable(side)
    with scheduler.posting():
        assert scheduler.reusable(fresh)
    assert NULL_SCHEDULER.reusable(None) and NULL_SCHEDULER.mark("own") is None


# ----------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_a_cuda_posting_does_not_wait_for_the_compute_stream() -> None:
    """A gather posted after a long kernel on the compute stream finishes while the kernel
    still runs: the side stream waits for the own-block mark, not the compute stream."""
    device = torch.device("cuda")
    scheduler = CudaStepScheduler(device)
    block = torch.randn(2, 1, 2, 4096, 64, device=device)
    index = torch.arange(0, 4096, 2, device=device)
    own = scheduler.mark("own")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of compute-stream work queued after the mark
    compute_done = torch.cuda.Event()
    compute_done.record()
    with scheduler.posting() as post:
        post.after(own)
        rows = post.made(block.index_select(3, index))
        gathered = post.mark("gathered", rows)
    gathered.event.synchronize()
    assert not compute_done.query(), "the posting waited for the compute stream"
    torch.cuda.synchronize()
    torch.testing.assert_close(rows, block[:, :, :, ::2])


class RecordingCuda(Recording, CudaStepScheduler):
    pass


@pytest.mark.gpu
def test_the_cuda_scheduler_keeps_the_rules_on_a_ring_rank() -> None:
    """Rank 1 of a ring of 4 on CUDA over the ``fake`` backend (received blocks are left as
    allocated, so values are not checked): the CUDA scheduler's graph obeys the same rules."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=WORLD)
    try:
        for case in CASES:
            logs: list[list[dict]] = []
            _run(case, WORLD, 1, torch.device("cuda"), _recorded(
                lambda log, ids, device: RecordingCuda(log, ids, device), logs))
            torch.cuda.synchronize()
            marks = {e["id"]: e for log in logs for e in log if e["kind"] == "mark"}
            problems = [p for log in logs for p in dependency_violations(log, marks)]
            assert not problems, (case, problems)
    finally:
        dist.destroy_process_group()
