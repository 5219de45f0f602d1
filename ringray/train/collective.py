"""Work that one rank does for all, without stranding the others when it fails.

    lineage = on_rank0(lambda: plan_run(store, resume=True, move_aside=False))

Rank 0 runs the function; its result, or the exception it raised, is broadcast, and every rank
returns the same result or raises the same exception. Without this, a rank-0-only step that
fails (a full disk, a run directory in use) leaves the other ranks waiting in their next
collective until it times out.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The process group's size, 1 outside torch.distributed."""
    return dist.get_world_size() if distributed() else 1


def is_rank0() -> bool:
    return not distributed() or dist.get_rank() == 0


def on_rank0(work: Callable[[], T]) -> T:
    """``work()`` on rank 0, its result (or its exception, raised) on every rank.

    An exception that cannot be pickled (a few library ones hold locks or handles) reaches
    the other ranks as a ``RuntimeError`` with its type and message, and rank 0 raises the
    original: the broadcast always happens, so no rank waits for it until the collective
    timeout (it did: rank 0 raised while pickling, before sending). A result that cannot be
    pickled is a ``RuntimeError`` on every rank.
    """
    outcome: list = [None, None]
    original = None
    if is_rank0():
        try:
            outcome[0] = work()
        except Exception as exc:
            outcome[1] = original = exc
        if distributed():
            outcome = _picklable(outcome)
    if distributed():
        dist.broadcast_object_list(outcome, src=0)
    if original is not None:
        raise original
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def _picklable(outcome: list) -> list:
    """``[result, exception]`` as it can be sent: what cannot be pickled becomes a
    ``RuntimeError`` saying what it was."""
    try:
        pickle.dumps(outcome)
        return outcome
    except Exception as exc:  # noqa: BLE001 - pickling raises many kinds
        result, error = outcome
        if error is not None:
            return [None, RuntimeError(f"{type(error).__name__}: {error}")]
        return [None, RuntimeError(f"rank 0's result ({type(result).__name__}) cannot be sent "
                                   f"to the other ranks: {exc}")]
