"""Replica groups (``parallel.dp_replicate``, :mod:`ringray.train.replicas`).

Pure parts and the trainer's hook with a fake torchft manager, in this process; then real
replica groups as plain processes (each its own gloo world) with torchft's Lighthouse in
this process: two groups equal one world of dp=2, and a group's death stops no other and
rolls back no step, and its replacement heals to the survivors' exact state.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest
import torch
from distributed import run_gloo_ranks
from replica_cases import (
    Done,
    Events,
    FakeManager,
    rank_sums_of_a_twin_quorum,
    record_replica_steps,
    start_group,
    stop,
    train_from_checkpoint,
    train_until_stopped,
)
from train_cases import gradients, rank_record_steps, tiny_options

from ringray.data import PackedLoader
from ringray.train import Trainer
from ringray.train.checkpoint import CheckpointStore
from ringray.train.options import ParallelOptions
from ringray.train.replicas import (
    ReplicaMembership,
    ReplicaSync,
    gradient_buckets,
    loader_slot,
    participation_scale,
    replica_rows,
    replica_world_size,
    sum_in_place,
)

STEPS = 3


# ----------------------------------------------------------------- pure parts
def test_slices_of_the_global_batch_are_those_of_one_world_of_replicas_times_dp() -> None:
    """Replica r's dp rank d reads slice r × dp + d of dp_replicate × dp: the same rows a
    world of dp_replicate × dp ranks reads, each exactly once."""
    count, dp, global_batch = 3, 2, 12
    slots = [loader_slot(r, count, d, dp) for r in range(count) for d in range(dp)]
    assert slots == [(i, count * dp) for i in range(count * dp)]
    rows = [replica_rows(r, count, global_batch) for r in range(count)]
    assert [list(r) for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_the_scale_is_exactly_one_with_every_replica_and_the_participants_mean_without(
) -> None:
    assert participation_scale(1000, 1000) == 1.0
    assert participation_scale(1000, 400) == 2.5
    assert participation_scale(10, 0) == 10.0  # no counted label: zero gradients anyway


def test_slice_counts_add_up_to_the_global_batch_count(tmp_path) -> None:
    """A replica's counted labels (its slice only) sum, over the replicas, to the global
    batch's, with documents and a loss mask alike (the divisor of the exact mean)."""
    options = tiny_options(str(tmp_path), data={"source": "passkey", "documents": True},
                           train={"seq_len": 256, "global_batch": 4})
    trainer = Trainer(options)
    loader: PackedLoader = trainer.loader
    for documents in (False, True):
        for index in range(3):
            total = loader.counted_labels(index, documents=documents)
            parts = [loader.counted_labels(index, documents=documents,
                                           rows=replica_rows(r, 2, 4)) for r in range(2)]
            assert sum(parts) == total
            assert 0 < parts[0] < total


# ----------------------------------------------------------------- bad input
def test_replicas_not_dividing_the_workers_is_one_line() -> None:
    assert replica_world_size(8, 2) == 4
    with pytest.raises(ValueError, match=r"^parallel.dp_replicate: 3 does not divide the 8 "
                                         r"workers into equal replica groups; use a divisor "
                                         r"of 8$"):
        replica_world_size(8, 3)


def test_a_global_batch_that_does_not_split_over_the_replicas_is_one_line(tmp_path) -> None:
    with pytest.raises(ValueError) as caught:
        tiny_options(str(tmp_path), parallel={"dp": 1, "dp_replicate": 2},
                     train={"global_batch": 3})
    assert str(caught.value) == (
        "train.global_batch: 3 does not split over parallel.dp_replicate=2 × dp=1 = 2 "
        "slices; use a multiple of 2")
    with pytest.raises(ValueError, match=r"^train.global_batch: 6 does not split over "
                                         r"parallel.dp_replicate=4 replica groups; use a "
                                         r"multiple of 4$"):
        tiny_options(str(tmp_path), parallel={"dp": None, "dp_replicate": 4},
                     train={"global_batch": 6})


def test_torchft_missing_is_one_line_before_anything_connects(monkeypatch, tmp_path) -> None:
    """Both the options (at the job file) and the sync (in a worker) refuse it."""
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now fails
    with pytest.raises(ValueError) as caught:
        ParallelOptions(dp_replicate=2)
    assert str(caught.value) == ("dp_replicate: 2 replica groups need torchft, which is not "
                                 "installed; pip install torchft, or use 1")
    group = ReplicaMembership(index=0, count=2, lighthouse="http://nowhere:1",
                         store=("127.0.0.1", 1))
    with pytest.raises(ValueError) as caught:
        ReplicaSync(group)
    message = str(caught.value)
    assert message.startswith("parallel.dp_replicate: replica groups need torchft, which "
                              "cannot be imported (")
    assert "\n" not in message


def test_a_trainer_of_replica_groups_without_its_sync_is_refused(tmp_path) -> None:
    options = tiny_options(str(tmp_path), parallel={"dp": 1, "dp_replicate": 2})
    with pytest.raises(ValueError, match=r"^parallel.dp_replicate: 2 replica groups need a "
                                         r"ReplicaSync per trainer"):
        Trainer(options)
    sync = ReplicaSync(ReplicaMembership(index=0, count=3, lighthouse="-", store=("-", 0)),
                       make_manager=_solo([]))
    with pytest.raises(ValueError, match=r"^parallel.dp_replicate: 2, but this replica group "
                                         r"was started as one of 3"):
        Trainer(options, replicas=sync)


def test_a_replica_index_outside_the_groups_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^replica index: 2 is not one of the 2 replica "
                                         r"groups \(0 to 1\)$"):
        ReplicaMembership(index=2, count=2, lighthouse="-", store=("-", 0))


# ----------------------------------------------------------------- the hook, a fake quorum
class _SoloManager(FakeManager):
    """A quorum of this replica group alone; ``should_commit`` answers from a script."""

    def __init__(self, commits: list[bool]) -> None:
        super().__init__()
        self.commits = list(commits)

    def should_commit(self) -> bool:
        return self.commits.pop(0)


def _solo(commits: list[bool]):
    return lambda group, rank, world, state_dict, load_state_dict: _SoloManager(commits)


def _solo_trainer(options, commits: list[bool], index: int = 0) -> Trainer:
    group = ReplicaMembership(index=index, count=options.parallel.dp_replicate, lighthouse="-",
                         store=("-", 0))
    return Trainer(options, replicas=ReplicaSync(group, make_manager=_solo(commits)))


def test_a_replica_alone_trains_on_its_slice_with_the_mean_over_its_own_labels(tmp_path
                                                                                ) -> None:
    """Replica 0 of 2 in a quorum of its own: its step is the mean over its slice's counted
    labels only, which is what one device training on that slice alone computes (batch 0's
    slice 0 is the first global batch of half the size); the other slice is dropped."""
    options = tiny_options(str(tmp_path / "r"), parallel={"dp": 1, "dp_replicate": 2},
                           train={"global_batch": 4})
    alone = _solo_trainer(options, [True])
    stats = alone.step()
    reference = Trainer(tiny_options(str(tmp_path / "one"), train={"global_batch": 2}))
    want = reference.step()
    assert stats.committed and stats.replicas_participating == [0]
    assert stats.samples_dropped == 2 and stats.quorum_size == 1
    assert stats.tokens == want.tokens == 2 * 64  # what was trained, not the global batch
    tol = {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(stats.loss, want.loss, **tol)
    torch.testing.assert_close(stats.grad_norm, want.grad_norm, **tol)
    for name, grad in gradients(reference).items():
        torch.testing.assert_close(gradients(alone)[name], grad, **tol)


def test_an_uncommitted_step_is_not_taken_and_its_batch_is_read_again(tmp_path) -> None:
    """A step torchft does not commit leaves no trace: the step count, the loader's position
    and the RNG are as before it, and the next attempt trains exactly what a run without
    the failure trains (same weights and AdamW state, bit for bit)."""
    options = tiny_options(str(tmp_path), parallel={"dp": 1, "dp_replicate": 2},
                           train={"global_batch": 4})
    failing = _solo_trainer(options, [True, False, True])
    failing.step()
    rng = torch.get_rng_state()
    stats = failing.step()
    assert not stats.committed and stats.step == 1 and stats.replicas_participating == []
    assert stats.samples_dropped == 0  # nothing dropped: the batch is tried again
    assert failing.step_count == failing.loader.next_index == 1
    assert torch.equal(torch.get_rng_state(), rng)
    assert failing.step().committed
    failing_state = failing.state_dict()
    clean = _solo_trainer(options, [True, True])
    for _ in range(2):
        clean.step()
    _assert_same_state(failing_state, clean.state_dict())


def _assert_same_state(got: dict, want: dict, path: str = "") -> None:
    """Equal state dicts: tensors bit for bit, everything else by value."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for key in want:
            _assert_same_state(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_state(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{path} differs"
    else:
        assert got == want, path


def test_a_replica_groups_manager_starts_when_its_trainer_is_built(tmp_path) -> None:
    """The torchft manager (which heartbeats at the Lighthouse) exists once the trainer is
    built, before its first step, and the step uses that one (none is made later)."""
    options = tiny_options(str(tmp_path), parallel={"dp": 1, "dp_replicate": 2},
                           train={"global_batch": 4})
    made = []

    def factory(group, rank, world, state_dict, load_state_dict):
        made.append((group.index, rank, world))
        return _SoloManager([True])

    group = ReplicaMembership(index=1, count=2, lighthouse="-", store=("-", 0))
    trainer = Trainer(options, replicas=ReplicaSync(group, make_manager=factory))
    assert made == [(1, 0, 1)]
    assert trainer.step().committed
    assert made == [(1, 0, 1)]


def test_a_standby_is_built_without_a_manager_and_takes_a_lost_groups_place(tmp_path
                                                                            ) -> None:
    """A standby group's trainer is built ahead with no place (index None): no torchft
    manager heartbeats for it, and it cannot step. Taking group 1's place starts group 1's
    manager and moves its loader to group 1's slice: its step then equals one of a trainer
    built as group 1 from the start (the same weights from the seed, the same slice)."""
    options = tiny_options(str(tmp_path), parallel={"dp": 1, "dp_replicate": 2},
                           train={"global_batch": 4})
    made = []

    def factory(group, rank, world, state_dict, load_state_dict):
        made.append(group.index)
        return _SoloManager([True])

    standby_group = ReplicaMembership(index=None, count=2, lighthouse="-", store=("-", 0))
    standby = Trainer(options, replicas=ReplicaSync(standby_group, make_manager=factory))
    assert made == []
    with pytest.raises(RuntimeError, match="takes a place before it trains"):
        standby.step()
    assert standby.loader.next_index == 0 and standby.step_count == 0  # nothing was read
    place = ReplicaMembership(index=1, count=2, lighthouse="-", store=("-", 0))
    standby.replicas.take_place(place)
    assert made == [1] and standby.loader.dp_rank == 1
    with pytest.raises(RuntimeError, match="already has a place"):
        standby.replicas.take_place(place)
    with pytest.raises(ValueError, match="one of the 2 groups' places"):
        ReplicaSync(standby_group, make_manager=factory).take_place(
            ReplicaMembership(index=1, count=3, lighthouse="-", store=("-", 0)))
    stats = standby.step()
    want = _solo_trainer(options, [True], index=1).step()
    assert stats.committed and stats.replicas_participating == [1]
    torch.testing.assert_close(stats.loss, want.loss, atol=0, rtol=0)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "replicated"])
def test_under_fsdp_the_cross_replica_sum_runs_inside_the_backward_in_place(tmp_path,
                                                                           fsdp: bool) -> None:
    """A ring of 2 ranks as replica group 0 beside a twin group (a fake quorum whose sum
    doubles). Under FSDP each unit's reduced gradient shards are handed to the sum inside
    the backward, as they are (the gradients' own storage, one hand-off per unit: 2 blocks
    and the root), and the tally after them; with replicated weights the tally comes first
    and the gradients go in buffers after the backward. Either way every gradient is summed
    exactly once: the twin's doubling, scaled back by the participants' labels, leaves the
    gradients of one world training on this group's slice alone."""
    parallel = {"dp": 1, "cp": 2, "fsdp": fsdp}
    options = tiny_options(str(tmp_path / "r"), parallel={**parallel, "dp_replicate": 2},
                           train={"global_batch": 4})
    got = run_gloo_ranks(2, rank_sums_of_a_twin_quorum, options, timeout_seconds=240)
    alone = tiny_options(str(tmp_path / "one"), parallel=parallel, train={"global_batch": 2})
    want = run_gloo_ranks(2, rank_record_steps, [alone], 1, timeout_seconds=240)[0][0]
    for rank in got:
        if fsdp:
            assert rank["handed"] == [("grad", True)] * 3 + [("tally", False)]
        else:
            assert rank["handed"] == [("tally", False), ("copy", False)]
        for name, grad in want["grads"][0].items():
            torch.testing.assert_close(rank["grads"][name], grad, atol=1e-6, rtol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------- real replica groups
def _lighthouse(**kwargs):
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", **kwargs)


def test_the_first_quorum_waits_for_a_group_that_heartbeats_and_not_for_one_unknown() -> None:
    """What the controller's start relies on (torchft's Lighthouse as the controller starts
    it: ``min_replicas=1``, a join timeout): a group alone forms a quorum at once when no
    other group is known, which is the start-up race a group's late manager caused; once the
    other group heartbeats (its manager is built), the first group's request waits for it,
    and both get one quorum of two."""
    import threading
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    def client(lighthouse):
        return LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=5))

    def ask(lighthouse, index: int, seconds: float):
        return client(lighthouse).quorum(f"ringray_replica_{index}",
                                         timeout=timedelta(seconds=seconds), step=0,
                                         world_size=1)

    unknown = _lighthouse(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    try:
        assert [m.replica_id for m in ask(unknown, 0, 5).participants] == [
            "ringray_replica_0"]
    finally:
        unknown.shutdown()
    known = _lighthouse(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    try:
        client(known).heartbeat("ringray_replica_1")
        with pytest.raises(TimeoutError):
            ask(known, 0, 1)
    finally:
        known.shutdown()
    # (a new Lighthouse: the request that timed out above may linger as a participant)
    known = _lighthouse(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    try:
        client(known).heartbeat("ringray_replica_1")
        quorums = {}
        first = threading.Thread(target=lambda: quorums.setdefault(0, ask(known, 0, 20)))
        first.start()
        first.join(timeout=1)
        assert first.is_alive()  # still waiting for group 1
        quorums[1] = ask(known, 1, 20)
        first.join(timeout=25)
        for index in (0, 1):
            assert sorted(m.replica_id for m in quorums[index].participants) == [
                "ringray_replica_0", "ringray_replica_1"]
    finally:
        known.shutdown()


def _two_groups(fn, args_of, *, timeout_seconds: float) -> Events:
    """Replica groups 0 and 1 (one rank each) running ``fn(..., *args_of(index, lighthouse
    address))`` against a Lighthouse that waits for both, until both are done; then every
    process and the Lighthouse are stopped. Returns what they reported."""
    lighthouse = _lighthouse(min_replicas=2, join_timeout_ms=100)
    ctx = mp.get_context("spawn")
    events = Events(ctx.Queue())
    groups = [start_group(ctx, r, 1, events.queue, fn, *args_of(r, lighthouse.address()))
              for r in range(2)]
    try:
        events.wait(lambda e: len(e.done) == 2, timeout_seconds=timeout_seconds,
                    what="both groups")
    finally:
        for procs in groups:
            stop(procs)
        lighthouse.shutdown()
    return events


def test_two_replica_groups_equal_one_world_of_dp2(tmp_path) -> None:
    """dp_replicate=2 × dp=1 (two processes, each its own world, averaging through torchft)
    gives the losses, gradients and weights of dp=2 in one world, step by step, with both
    groups in every step (the Lighthouse waits for two)."""
    options = tiny_options(str(tmp_path / "r2"), parallel={"dp": 1, "dp_replicate": 2},
                           train={"global_batch": 4})
    events = _two_groups(record_replica_steps, lambda r, address: (options, address, STEPS),
                         timeout_seconds=240)
    world = tiny_options(str(tmp_path / "dp2"), parallel={"dp": 2}, train={"global_batch": 4})
    want = run_gloo_ranks(2, rank_record_steps, [world], STEPS, timeout_seconds=240)[0][0]
    for r in range(2):
        got = events.done[(r, 0)]
        assert got["committed"] == [True] * STEPS
        assert got["participating"] == [[0, 1]] * STEPS
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   atol=0, rtol=0)
        for step in range(STEPS):
            for name, grad in want["grads"][step].items():
                torch.testing.assert_close(got["grads"][step][name], grad, atol=0, rtol=0,
                                           msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
        for name, weight in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], weight, atol=0, rtol=0)


# slow: it passed alone (about 33 s) but once waited past its limits in a full-suite run, its
# two finished groups blocked at exit flushing their result queue; left to `make test-all`
# until that is understood.
@pytest.mark.slow
def test_a_dead_group_stops_no_other_and_its_replacement_heals_exactly(tmp_path) -> None:
    """Two groups of one rank; group 1 dies (os._exit) inside a step both are in. Group 0's
    step is not committed, then it commits alone (group 1's slices dropped, no step rolled
    back, its loader at its step); a replacement group 1 heals from it at a step boundary,
    both then commit together and end bit-identical (weights, AdamW state, loader, RNG,
    step)."""
    _dead_group_and_replacement(tmp_path, ranks=1)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_a_dead_ring_group_stops_no_other_and_its_replacement_heals_exactly(tmp_path,
                                                                             fsdp: bool
                                                                             ) -> None:
    """The same with groups of two ranks each (a ring of cp=2): every rank averages with
    the same rank of the other group and heals from it; under FSDP each rank's shards
    (weights and AdamW state) travel as its local tensors and end bit-identical."""
    _dead_group_and_replacement(tmp_path, ranks=2, fsdp=fsdp)


def _dead_group_and_replacement(tmp_path, *, ranks: int, fsdp: bool = False) -> None:
    lighthouse = _lighthouse(min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=2000)
    ctx = mp.get_context("spawn")
    events = Events(ctx.Queue())
    stop_at = ctx.Value("i", 0)
    options = tiny_options(str(tmp_path), train={"global_batch": 4, "steps": 100_000},
                           parallel={"dp": 1, "cp": ranks, "dp_replicate": 2, "fsdp": fsdp})
    address = lighthouse.address()
    procs: list[mp.Process] = []
    try:
        procs += start_group(ctx, 0, ranks, events.queue, train_until_stopped, options,
                             address, 0, stop_at, None, None)
        procs += start_group(ctx, 1, ranks, events.queue, train_until_stopped, options,
                             address, 0, stop_at, 2, None)
        events.wait(lambda e: e.died, timeout_seconds=180, what="group 1 to die")
        death = events.died[0]
        events.wait(lambda e: sum(1 for s in e.of(0) if s["committed"]
                                  and s["participating"] == [0]) >= 2,
                    timeout_seconds=60, what="group 0 to commit alone")
        stop([p for p in procs[ranks:]])  # the rest of the dead group, as its agent would
        replaced_at = _now()
        procs += start_group(ctx, 1, ranks, events.queue, train_until_stopped, options,
                             address, 1, stop_at, None, 3)
        events.wait(lambda e: len(e.done) == 2 * ranks, timeout_seconds=180,
                    what="both groups to stop")
    finally:
        stop(procs)
        lighthouse.shutdown()

    for rank in range(ranks):
        survivor = events.of(0, rank=rank)
        steps = [s["step"] for s in survivor]
        # never a step rolled back: each record is the previous step or the next one
        assert all(b - a in (0, 1) for a, b in zip(steps, steps[1:], strict=False)), steps
        assert all(s["loader_index"] == s["step"] for s in survivor)
        after = [s for s in survivor if s["wall"] > death["wall"]]
        assert after and not after[0]["committed"]  # the step the dead group was in
        alone = [s for s in after if s["committed"] and s["participating"] == [0]]
        assert alone and all(s["samples_dropped"] == 2 for s in alone)
        healed = [s for s in events.of(1, rank=rank, incarnation=1) if s["healed"]]
        assert len(healed) == 1 and healed[0]["committed"]
        joint = [s for s in survivor if s["wall"] > healed[0]["wall"] - 1e-3
                 and s["participating"] == [0, 1]]
        assert len(joint) >= 3
        final_0, final_1 = events.done[(0, rank)], events.done[(1, rank)]
        assert final_0["step"] == final_1["step"] == stop_at.value
        _assert_same_state(final_1["state"], final_0["state"])
    first_alone = alone[0]
    print(f"\nreplica death to the survivor's next commit: "
          f"{first_alone['wall'] - death['wall']:.2f} s; replacement started to healed: "
          f"{healed[0]['wall'] - replaced_at:.2f} s, heal {healed[0]['heal_seconds']:.2f} s")


def _now() -> float:
    import time

    return time.time()


def test_ringray_train_takes_replica_groups_and_counts_their_workers() -> None:
    """`ringray train` starts replica groups (ringray.cluster.replica_groups): the job file
    is accepted, and its workers are dp_replicate x dp x cp."""
    from ringray.spec.load import parse_job_spec

    spec = parse_job_spec({"parallel": {"dp": 1, "cp": 2, "dp_replicate": 2},
                           "train": {"global_batch": 2}})
    job = spec.job_options()
    assert (job.replicas, job.dp_max, job.cp) == (2, 1, 2)


def test_steps_lines_from_before_replica_groups_still_load() -> None:
    """A steps.jsonl line without the replica fields is a committed step of one group."""
    from ringray.train.step_stats import StepStats

    fields = {"step": 3, "loss": 2.5, "grad_norm": 1.0, "learning_rate": 1e-3,
              "step_seconds": 0.5, "tokens": 128, "tokens_per_second": 256.0,
              "attention_compute_seconds": [0.1], "exposed_comm_seconds": [0.0],
              "overlap_ratio": 1.0, "load_imbalance": 1.0, "mfu": None,
              "peak_memory_bytes": 1}
    stats = StepStats(**fields)
    assert (stats.committed, stats.quorum_size, stats.replicas_participating,
            stats.samples_dropped, stats.healed, stats.heal_seconds) == (True, 1, [], 0,
                                                                          False, 0.0)


def test_torchft_advertises_the_address_of_the_route_to_the_lighthouse_not_the_host_name(
) -> None:
    """torchft's manager and checkpoint server advertised ``socket.gethostname()``: on hosts
    whose names do not resolve elsewhere (KubeRay pods, the namespaced hosts of
    tests/test_hosts.py) every group waited for an address nobody could reach. The address
    advertised is the local end of the route to the Lighthouse, in URL form; torchft's real
    HTTP checkpoint server (the transport ringray gives the manager) serves at it."""
    from datetime import timedelta

    import torchft

    from ringray.train.replicas import _advertising_transport, advertised_host

    assert advertised_host("http://127.0.0.1:29510") == "127.0.0.1"
    assert advertised_host("127.0.0.1:1") == "127.0.0.1"
    assert advertised_host("http://[::1]:80") == "[::1]"
    with pytest.raises(ValueError, match=r"names no host"):
        advertised_host("http://:4")
    transport = _advertising_transport(torchft, "198.18.0.9", timedelta(seconds=5))
    try:
        assert transport.address().startswith("http://198.18.0.9:")
        assert transport.address().endswith("/checkpoint/")
        assert transport.metadata() == transport.address()  # what a healing peer is told
    finally:
        transport.shutdown(wait=False)


# ----------------------------------------------------------------- torchft's step
@pytest.mark.parametrize(("behind", "perturb", "transport"),
                         [(None, False, "http"), (2, False, "http"), (4, True, "http"),
                          (None, False, "process_group")],
                         ids=["fresh-replacement", "older-checkpoint", "same-step-other-state",
                              "fresh-replacement-over-the-process-group"])
def test_groups_that_would_average_different_weights_heal_first(tmp_path, behind: int | None,
                                                                 perturb: bool, transport: str
                                                                 ) -> None:
    """Group 0 restores step 4; group 1 starts from the seed's weights (a replacement joining
    the first quorum after a restart), restores step 2 (its own fallback), or restores step 4
    and holds another state (a digest that differed: the controller makes it fall behind).
    torchft heals a group only when its manager's step is behind, and every manager counts
    from 0 at start: before the managers' step was set from the trainers', none of these
    healed and the groups averaged gradients of different weights every step. Now group 1
    heals from group 0 at its first step, trains steps 5 and 6 with it, and both end bit for
    bit the same (weights, AdamW state, loader, RNG, step). The state comes over torchft's
    HTTP checkpoint server, or over the replica process group (``process_group``)."""
    options = tiny_options(str(tmp_path), parallel={"dp": 1, "dp_replicate": 2},
                           train={"global_batch": 4}, checkpoint={"keep": 3})
    saver = _solo_trainer(options, [True] * 4)
    store = CheckpointStore(options.checkpoint_location)
    for step in range(1, 5):
        saver.step()
        if step % 2 == 0:
            saver.save_checkpoint(store)
    restores = {0: 4, 1: behind}
    events = _two_groups(train_from_checkpoint, lambda r, address: (
        options, address, restores[r], perturb and r == 1, 6, transport), timeout_seconds=120)
    ahead, healing = events.done[(0, 0)], events.done[(1, 0)]
    want = [{"step": s, "committed": True, "healed": False, "participating": [0, 1]}
            for s in (5, 6)]
    assert ahead["steps"] == want
    assert healing["steps"] == [{**want[0], "healed": True}, want[1]]
    _assert_same_state(healing["state"], ahead["state"])


# ----------------------------------------------------------------- the in-place sum
def test_gradient_buckets_keep_order_and_size_and_give_a_large_gradient_its_own() -> None:
    assert gradient_buckets([4, 4, 4, 4], limit=8) == [[0, 1], [2, 3]]
    assert gradient_buckets([4, 20, 4, 5, 3], limit=8) == [[0], [1], [2], [3, 4]]
    assert gradient_buckets([8, 1], limit=8) == [[0], [1]]
    assert gradient_buckets([], limit=8) == []


class _Doubling:
    """A quorum of two groups holding the same gradients: a sum doubles each tensor (in
    place, as a process group does); records what it was handed."""

    def __init__(self) -> None:
        self.handed: list[torch.Tensor] = []

    def allreduce(self, tensor: torch.Tensor, *, reduce_op: object) -> Done:
        self.handed.append(tensor)
        tensor.mul_(2)
        return Done()


@pytest.mark.parametrize("limit", [1, 40, 64, 2**20])
def test_the_sum_lands_in_every_gradient_in_place_whatever_the_buckets(limit: int) -> None:
    """Gradients of 3, 10 (non-contiguous: a transposed view), 1 and 16 float32 elements:
    whatever the bucket size, each gradient ends up holding the sum (here twice itself),
    the same tensor objects are updated, and a contiguous gradient of a bucket of its own is
    summed where it is, with no buffer."""
    grads = [torch.arange(3.0), torch.arange(10.0).reshape(2, 5).t(), torch.tensor([7.0]),
             torch.arange(16.0).reshape(4, 4)]
    want = [2 * g.clone() for g in grads]
    manager = _Doubling()
    sum_in_place(manager, grads, limit=limit)
    for got, expected in zip(grads, want, strict=True):
        assert torch.equal(got, expected)
    if limit == 1:  # every gradient its own bucket: only the transposed one needs a buffer
        assert [h.data_ptr() for h in manager.handed if h.numel() != 10] == [
            grads[i].data_ptr() for i in (0, 2, 3)]
    if limit == 2**20:
        assert len(manager.handed) == 1 and manager.handed[0].numel() == 30
