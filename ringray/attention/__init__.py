"""Exact attention over a sequence split across a ring of ranks (no Ray, no pydantic).

    from ringray.attention import ring_attention, make_layout, RingStats
"""

from ringray.attention.layouts import Layout, causal_work, make_layout
from ringray.attention.merge import merge
from ringray.attention.ring import ring_attention
from ringray.attention.stats import RingStats, RingStepRecord, RingTotals

__all__ = [
    "Layout",
    "RingStats",
    "RingStepRecord",
    "RingTotals",
    "causal_work",
    "make_layout",
    "merge",
    "ring_attention",
]
