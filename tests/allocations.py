"""The CPU allocator's history from a torch profiler run, for the memory tests (one home for
walking the profiler's event tree)."""

from __future__ import annotations


def allocation_events(prof) -> list[tuple[int, int, int]]:
    """``(start ns, size, total allocated after it)`` of every allocation and free (negative
    size) that ``prof`` (``profile(..., profile_memory=True)``) recorded, in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size,
                           node.typed[1].total_allocated))
    return sorted(events)
