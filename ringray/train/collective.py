"""Work that one rank does for all, without stranding the others when it fails.

    lineage = on_rank0(lambda: plan_run(store, resume=True, move_aside=False))

Rank 0 runs the function; its result, or the exception it raised, is broadcast, and every rank
returns the same result or raises the same exception. Without this, a rank-0-only step that
fails (a full disk, a run directory in use) leaves the other ranks waiting in their next
collective until it times out.
"""

from __future__ import annotations

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

    Exceptions must be picklable (ringray's are; a few library ones are not: those are
    re-raised on the other ranks as ``RuntimeError`` with the same message).
    """
    outcome: list = [None, None]
    if is_rank0():
        try:
            outcome[0] = work()
        except Exception as exc:
            outcome[1] = exc
    if distributed():
        try:
            dist.broadcast_object_list(outcome, src=0)
        except (TypeError, AttributeError, RuntimeError) as exc:  # an unpicklable exception
            if outcome[1] is None or not is_rank0():
                raise
            raise outcome[1] from exc
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]
