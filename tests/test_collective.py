"""``on_rank0`` (ringray.train.collective) in real two-rank gloo runs: rank 0's failure reaches
every rank at once, even when the exception cannot be pickled."""

from __future__ import annotations

import threading

from distributed import run_gloo_ranks

from ringray.train.collective import on_rank0


class _HoldsALock(Exception):
    """A library exception of the kind that cannot be pickled (it holds a lock)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def _raise_unpicklable() -> None:
    raise _HoldsALock("disk on fire")


def rank_on_rank0(rank: int, world: int, what: str) -> str:
    work = {"unpicklable": _raise_unpicklable,
            "value": lambda: {"step": 7},
            "unpicklable result": lambda: threading.Lock()}[what]
    try:
        return repr(on_rank0(work))
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(exc).__name__}: {exc}"


def test_an_unpicklable_exception_reaches_every_rank_at_once() -> None:
    """Rank 0 raised while pickling its exception for the broadcast, and rank 1 waited in
    the broadcast until the collective timeout (issue 40). Now rank 0 raises the original
    and rank 1 a RuntimeError naming it, well within the 30 s this run allows."""
    got = run_gloo_ranks(2, rank_on_rank0, "unpicklable", timeout_seconds=60,
                         collective_timeout_seconds=30)
    assert got == ["_HoldsALock: disk on fire", "RuntimeError: _HoldsALock: disk on fire"]


def test_a_result_reaches_every_rank_and_an_unpicklable_one_fails_on_each() -> None:
    got = run_gloo_ranks(2, rank_on_rank0, "value", timeout_seconds=60)
    assert got == ["{'step': 7}"] * 2
    got = run_gloo_ranks(2, rank_on_rank0, "unpicklable result", timeout_seconds=60,
                         collective_timeout_seconds=30)
    assert all(line.startswith("RuntimeError: rank 0's result (lock) cannot be sent")
               for line in got), got
