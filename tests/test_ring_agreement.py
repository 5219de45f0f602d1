"""A ring context's agreement (:class:`ringray.attention.RingAgreement`): each call signature
is agreed across the ring once, so steady-state calls (every layer, every step) make no
host round-trip, while the first call of a signature still fails every rank in one line.

The all-reduces are counted by wrapping :func:`ringray.attention.comm.agree_max` (which
every agreement goes through) in each rank's process."""

from __future__ import annotations

import time

import torch
from distributed import run_gloo_ranks
from train_cases import tiny_options

import ringray.attention.comm as comm_module
from ringray.attention import RingAgreement, make_layout, ring_attention


def _count_agreements() -> list[int]:
    calls = [0]
    real = comm_module.agree_max

    def counting(values, group):
        calls[0] += 1
        return real(values, group)

    comm_module.agree_max = counting
    return calls


def _sharded(rank: int, world: int, seq: int, seed: int):
    torch.manual_seed(seed)  # the same global tensors on every rank
    layout = make_layout("zigzag", world, seq)
    q = torch.randn(1, seq, 4, 8)
    k, v = torch.randn(1, seq, 2, 8), torch.randn(1, seq, 2, 8)
    return layout, [layout.shard(t, rank) for t in (q, k, v)]


def calls_with_and_without_agreement(rank: int, world: int) -> dict:
    """Five calls (three alike, one with a window, the first again) under one agreement,
    then the same five without: the outputs, and the all-reduces each made."""
    calls = _count_agreements()
    plan = [(0, None), (1, None), (2, None), (3, 5), (0, None)]
    results = {}
    for name, agreement in (("agreed", RingAgreement()), ("per_call", None)):
        before = calls[0]
        outs = []
        for seed, window in plan:
            layout, (q, k, v) = _sharded(rank, world, 24, seed)
            outs.append(ring_attention(q, k, v, layout=layout, window=window,
                                       agreement=agreement))
        results[name] = {"outs": outs, "all_reduces": calls[0] - before,
                         "agreed_calls": agreement.agreed_calls if agreement else None}
    return results


def bad_calls_under_an_agreement(rank: int, world: int) -> list[str]:
    """Under one agreement: a first call with bad heads on rank 1 alone; a good call; then a
    call that every rank makes with a bad window (its local check fails everywhere)."""
    agreement = RingAgreement()
    messages = []
    layout, (q, k, v) = _sharded(rank, world, 24, 0)
    for args, window in (((q[:, :, :3] if rank == 1 else q, k, v), None), ((q, k, v), None),
                         ((q, k, v), 0)):
        try:
            ring_attention(*args, layout=layout, window=window, agreement=agreement)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def agreement_cases(rank: int, world: int) -> tuple[dict, list[str]]:
    return calls_with_and_without_agreement(rank, world), bad_calls_under_an_agreement(rank,
                                                                                       world)


def test_a_signature_is_agreed_once_per_context_and_a_first_bad_call_fails_every_rank(
        ) -> None:
    """Five calls with two signatures make two all-reduces (not five) and the same outputs;
    under a fresh agreement, a bad call on one rank still fails every rank in one line, and
    a call every rank makes badly raises each rank's own error. (One spawn of three ranks.)"""
    outcomes = run_gloo_ranks(3, agreement_cases, timeout_seconds=180)
    for result, _ in outcomes:
        assert result["agreed"]["all_reduces"] == 2  # the plain signature and the window's
        assert result["agreed"]["agreed_calls"] == 2
        assert result["per_call"]["all_reduces"] == 5
        for got, want in zip(result["agreed"]["outs"], result["per_call"]["outs"],
                             strict=True):
            assert torch.equal(got, want)
    messages = [m for _, m in outcomes]
    assert "k: kv_heads=2 must divide q_heads=3" in messages[1][0]
    for rank in (0, 2):
        assert "rank 1 of the ring rejected its inputs (k)" in messages[rank][0]
    for rank in range(3):
        assert messages[rank][1] == "no error"
        assert messages[rank][2].startswith("window: expected a positive integer")


def one_rank_differs_after_agreeing(rank: int, world: int) -> tuple[str, float]:
    """What an agreement gives up: after a signature is agreed, rank 1 alone calls with
    another sequence length. It asks for an agreement the others skip; they wait in the
    exchange. Every rank fails on the collective timeout, not in one line."""
    agreement = RingAgreement()
    layout, (q, k, v) = _sharded(rank, world, 24, 0)
    ring_attention(q, k, v, layout=layout, agreement=agreement)
    if rank == 1:
        layout, (q, k, v) = _sharded(rank, world, 48, 0)
    started = time.monotonic()
    try:
        ring_attention(q, k, v, layout=layout, agreement=agreement)
        return "no error", time.monotonic() - started
    except Exception as exc:  # a timeout: RuntimeError / DistBackendError from gloo
        return type(exc).__name__, time.monotonic() - started


def steps_agreements(rank: int, world: int, run_dir: str) -> list[int]:
    from ringray.train import Trainer

    calls = _count_agreements()
    trainer = Trainer(tiny_options(run_dir, parallel={"cp": 2}, train={"steps": 3}))
    per_step = []
    for _ in range(3):
        before = calls[0]
        trainer.step()
        per_step.append(calls[0] - before)
    return per_step


def test_a_rank_that_alone_differs_after_agreeing_fails_every_rank_at_the_timeout() -> None:
    results = run_gloo_ranks(2, one_rank_differs_after_agreeing, timeout_seconds=120,
                             collective_timeout_seconds=4)
    for name, seconds in results:
        assert name not in ("no error", "ValueError")
        assert 3 <= seconds < 60


def test_a_trainers_steady_state_steps_make_no_agreement(tmp_path) -> None:
    """The trainer keeps one agreement per ring context: its first step agrees once (every
    layer's ring_attention has the same signature; recomputation and later steps reuse it).
    (Its own spawn: the test above needs a 4 s collective timeout, too short for a trainer's
    build on a loaded machine.)"""
    for per_step in run_gloo_ranks(2, steps_agreements, str(tmp_path), timeout_seconds=240):
        assert per_step == [1, 0, 0]
